"""MoE routing replay across a step (``algo.routing_replay``, ``algo.router_agreement``): which
routes each of the policy's passes replays, and the routing metrics.

The step's passes (``grpo.add_logprobs``, ``grpo.update_policy``) ask :class:`StepRouting` for the
:class:`~megatron_rl.models.routing_replay.Routes` of each pass; the policy does the replaying.

- ``off``: every pass routes freely.
- ``r2``: the old-policy log-prob pass records its routes into the batch (position field
  ``old_routes``); every update pass (each mini-batch, each of ``n_sgd``) replays them, so the ratio's
  numerator and denominator go through the same experts. Without an old pass (strictly on-policy) the
  update routes freely: its routers are the old pass's.
- ``r3``: the old pass and every update pass replay the engine's routes (``engine_routes``: what the
  rollout engine chose when it sampled, :mod:`megatron_rl.rollout.routes`), so the trainer's
  log-probs are those of the engine's experts.

Metrics, against the engine's routes (``algo.router_agreement``, or whenever they are at hand):
``moe/router_agreement``, the share of (position, MoE layer) pairs whose top-k expert set the
trainer's routers choose as the engine did, over the positions that predict the model's response
tokens, from a pass that routes freely (the old pass, or one more forward under r3);
``moe/train_infer_logp_gap_free`` and, under r3, ``moe/train_infer_logp_gap_replay``: the mean
|trainer - engine| log-prob of the model's response tokens without and with replay. A multi-turn
trajectory's tool observations (loss mask 0: the engine sampled none of them, their rollout
log-prob is 0.0) count in neither; their rows are replayed all the same (the tokens after them
attend to them).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_rl.algo import AlgoConfig
from megatron_rl.models.batch import LOSS_MASK, SequenceBatch
from megatron_rl.models.routing_replay import Routes

ENGINE = "engine_routes"  # position field: the rollout engine's routes
OLD = "old_routes"  # position field: the old-policy pass's routes (r2)


def engine_routes(routes: np.ndarray | None, length: int, where: str,
                  untrained: tuple[int, int] | None = None) -> torch.Tensor:
    """A completion's engine routes (``[length - 1, L, k]``: every position but the last token's) as
    the position field ``[length, L, k]``, the last token's row a copy of the one before (its output
    predicts nothing).

    ``untrained`` (``(L, k)``): the completion has no token of the model's (a multi-turn trajectory
    whose environment's first observation filled its room: no forward ever ran on it), so it has no
    routes and nothing of it is trained on; its rows are experts ``0 .. k-1`` everywhere."""
    if routes is None and untrained is not None:
        layers, k = untrained
        return torch.arange(k, dtype=torch.int16).expand(length, layers, k).clone()
    if routes is None:
        raise RuntimeError(f"{where}: the engine returned no MoE routes (algo.routing_replay=r3 / "
                           f"algo.router_agreement need them)")
    rows = torch.from_numpy(np.ascontiguousarray(routes)).to(torch.int16)
    if rows.shape[0] != length - 1:
        raise RuntimeError(f"{where}: {rows.shape[0]} rows of routes for a sequence of {length} tokens "
                           f"(need {length - 1})")
    return torch.cat([rows, rows[-1:]])  # (a valid row: distinct experts)


def router_agreement(trainer: list[torch.Tensor], engine: list[torch.Tensor], prompt_lens: list[int],
                     lengths: list[int], masks: list[torch.Tensor] | None = None) -> float:
    """The share of (position, layer) top-k sets equal between ``trainer`` and ``engine`` routes,
    over the positions that predict response tokens (``prompt_len - 1 .. len - 2``), of those only
    the ones that predict a token of ``masks`` (per sequence, one bool per response token: the
    model's tokens of a multi-turn trajectory) when given."""
    equal = total = 0
    for i, (t, e, p, n) in enumerate(zip(trainer, engine, prompt_lens, lengths)):
        lo, hi = p - 1, n - 1
        if hi <= lo:
            continue
        a = torch.sort(t[lo:hi].long(), -1).values
        b = torch.sort(e[lo:hi].long(), -1).values
        same = (a == b).all(-1)
        if masks is not None:
            same = same[masks[i].bool()]
        equal += int(same.sum())
        total += same.numel()
    return equal / total if total else float("nan")


def logp_gap(logp: list[torch.Tensor], rollout_logp: list[torch.Tensor],
             masks: list[torch.Tensor] | None = None) -> float:
    """Mean over sequences of the mean |trainer - engine| log-prob of their response tokens (of
    those in ``masks`` when given; a sequence with none counts not)."""
    gaps = []
    for i, (lp, rl) in enumerate(zip(logp, rollout_logp)):
        diff = (lp - rl).abs()
        if masks is not None:
            diff = diff[masks[i].bool()]
        if diff.numel():
            gaps.append(diff.mean().item())
    return sum(gaps) / max(1, len(gaps))


def _engine(batch: SequenceBatch) -> list[torch.Tensor]:
    """The batch's engine routes (r3); a batch of completions that all came without them is refused
    as one without them would be (``engine_routes``)."""
    if ENGINE not in batch.position_fields:
        raise RuntimeError(f"none of the batch's {len(batch)} completions has MoE routes: the engine returned "
                           f"none (algo.routing_replay=r3 needs them)")
    return batch.position_fields[ENGINE]


class StepRouting:
    """One step's routing replay (see the module doc)."""

    def __init__(self, a: AlgoConfig):
        self.mode = a.routing_replay
        self.measure = a.router_agreement

    @property
    def active(self) -> bool:
        return self.mode != "off" or self.measure

    def old_pass(self, batch: SequenceBatch) -> Routes | None:
        """The old-policy log-prob pass: r3 replays the engine's routes; r2 (and the agreement
        metric, when the pass routes freely) records."""
        if self.mode == "r3":
            return Routes(replay=_engine(batch))
        if self.mode == "r2" or (self.measure and ENGINE in batch.position_fields):
            return Routes(record=True)
        return None

    def after_old_pass(self, batch: SequenceBatch, routes: Routes | None, logp: list[torch.Tensor]) -> dict:
        """Keep what the old pass recorded (r2) and its metrics."""
        metrics: dict = {}
        if routes is None:
            return metrics
        if self.mode == "r2":
            batch.position_fields[OLD] = routes.recorded
        if self.mode == "r3":
            metrics["moe/train_infer_logp_gap_replay"] = logp_gap(logp, batch.token_fields["rollout_logp"],
                                                                   batch.token_fields.get(LOSS_MASK))
        elif routes.recorded is not None and ENGINE in batch.position_fields:
            metrics.update(self._free_metrics(batch, routes.recorded, logp))
        return metrics

    def diagnose(self, policy, batch: SequenceBatch, temperature: float, measured: bool) -> dict:
        """The agreement metric when the step has not measured it yet (``measured``): one more
        forward pass, routing freely (collective)."""
        if not self.measure or measured or ENGINE not in batch.position_fields:
            return {}
        routes = Routes(record=True)
        logp, _ = policy.compute_logprobs(batch, temperature, with_entropy=False, routes=routes)
        return self._free_metrics(batch, routes.recorded, logp)

    def update_pass(self, batch: SequenceBatch) -> Routes | None:
        """Every update pass (a mini-batch of the step's batch): r3 the engine's routes, r2 the old
        pass's."""
        if self.mode == "r3":
            return Routes(replay=_engine(batch))
        if self.mode == "r2" and OLD in batch.position_fields:
            return Routes(replay=batch.position_fields[OLD])
        return None

    @staticmethod
    def _free_metrics(batch: SequenceBatch, recorded: list[torch.Tensor], logp: list[torch.Tensor]) -> dict:
        lengths = [len(s) for s in batch.sequences]
        masks = batch.token_fields.get(LOSS_MASK)  # multi-turn: the model's tokens only
        return {"moe/router_agreement": router_agreement(recorded, batch.position_fields[ENGINE],
                                                         batch.prompt_lens, lengths, masks),
                "moe/train_infer_logp_gap_free": logp_gap(logp, batch.token_fields["rollout_logp"], masks)}
