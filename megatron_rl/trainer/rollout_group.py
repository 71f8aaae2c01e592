"""One prompt's group of samples in the async rollout scheduler, how a sample stopped part-way is
joined to its continuation, and groups as the step's rollout.

Owns: :class:`Group` (from dispatch to training), :func:`join_completions`.
May call: :class:`~megatron_rl.rollout.base.Completion`, ``algo.filter_groups``, the trainer's
:class:`~megatron_rl.trainer.phases.Rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo import AlgoConfig, filter_groups
from megatron_rl.rollout import Completion
from megatron_rl.trainer.phases import Rollout


@dataclass
class Group:
    """One prompt's ``group_size`` samples, from dispatch to training."""

    wave: int  # the step the prompt was drawn for
    index: int  # its position among that step's draws (its seed offset)
    record: int  # index into the loader's records
    dispatch_version: int  # the engine's weights when it was dispatched
    completions: list[Completion] | None = None
    rewards: list[float] | None = None
    # The verifier's verdict per completion ({"status", "extracted", ...}): the rollout dumps' answers.
    outcomes: list[dict] | None = None

    @property
    def tag(self) -> tuple[int, int]:
        return (self.wave, self.index)

    @property
    def version(self) -> int:
        """Its oldest token's weight version."""
        return min(c.weight_version for c in self.completions) if self.completions else self.dispatch_version

    @property
    def partial(self) -> bool:
        """Some of its samples were stopped part-way (finish reason ``abort``): to be continued."""
        return bool(self.completions) and any(c.finish_reason == "abort" for c in self.completions)


def join_completions(part: Completion, rest: Completion) -> Completion:
    """A sample stopped part-way (``part``) and its continuation (``rest``, sampled from the prompt
    followed by ``part``'s tokens) as one completion: tokens, log-probs, text, and each token's
    weight version (spans) end to end; finish reason and truncation are the continuation's."""
    n = len(part.token_ids)
    spans = [(v, a, b) for v, a, b in (part.version_spans or [(part.weight_version, 0, n)]) if b > a]
    for v, a, b in rest.version_spans or [(rest.weight_version, 0, len(rest.token_ids))]:
        if b <= a:
            continue
        if spans and spans[-1][0] == v and spans[-1][2] == a + n:
            spans[-1] = (v, spans[-1][1], b + n)
        else:
            spans.append((v, a + n, b + n))
    versions = {v for v, _, _ in spans}
    return Completion(token_ids=list(part.token_ids) + list(rest.token_ids),
                      logprobs=list(part.logprobs) + list(rest.logprobs), text=part.text + rest.text,
                      finish_reason=rest.finish_reason, truncated=rest.truncated,
                      weight_version=spans[0][0] if spans else rest.weight_version,
                      version_spans=spans if len(versions) > 1 else [], engine=rest.engine,
                      extra={**part.extra, **rest.extra}, routes=_join_routes(part, rest))


def _join_routes(part: Completion, rest: Completion):
    """MoE routes of a joined sample: each row from the forward that sampled with it first. ``rest``
    (prompt + ``part``'s tokens) recomputed every position; the rows that predicted ``part``'s tokens
    (all of ``part``'s rows) keep their own, the continuation's rows follow."""
    if rest.routes is None:
        return None
    if part.routes is None:  # stopped before any row came back: the continuation computed them all
        return rest.routes
    import numpy as np

    return np.concatenate([part.routes, rest.routes[len(part.routes):]])


def has_variance(g: Group, algo: AlgoConfig) -> bool:
    """The group's rewards vary (DAPO's dynamic sampling keeps it: ``algo.filter_groups``)."""
    rewards = torch.tensor(g.rewards, dtype=torch.float32)
    keep, _ = filter_groups(rewards, torch.zeros(len(g.rewards), dtype=torch.long), algo)
    return bool(keep.all())


def as_rollout(groups: list[Group], records: list) -> Rollout:
    """Scored groups as the step's rollout (``records``: the loader's)."""
    recs = [records[g.record] for g in groups]
    flat = [c for g in groups for c in g.completions]
    gids = torch.tensor([i for i, g in enumerate(groups) for _ in g.completions], dtype=torch.long)
    return Rollout(records=recs, completions=flat, group_ids=gids,
                   rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
                   truncated=torch.tensor([c.truncated for c in flat], dtype=torch.bool),
                   outcomes=[o for g in groups for o in (g.outcomes or [{}] * len(g.completions))])
