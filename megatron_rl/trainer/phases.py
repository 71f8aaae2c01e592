"""The phases of one GRPO step, each a function the loop in ``grpo.py`` calls in order.

generate -> score -> make_batch (reward shaping, filter groups, advantages) -> old / reference /
teacher log-probs (and the KL-shaped advantages with ``algo.kl.as_reward``, the token masks with
``algo.token_mask``) -> update -> sync.
The math lives in ``megatron_rl.algo``; this module only moves data between the components. Each
phase takes the components and the config section it uses (``rollout``, ``algo``), never the run.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from megatron_rl.algo import (AlgoConfig, compute_advantages, filter_groups, kl_reward_penalty,
                              policy_objective, sgd_schedule, shape_rewards)
from megatron_rl.data import PromptRecord
from megatron_rl.envs.metrics import episode_metrics
from megatron_rl.envs.render import TurnRenderer, check_messages
from megatron_rl.models.batch import LOSS_MASK, MicroBatch, SequenceBatch, pad_token_fields
from megatron_rl.rewards import RewardItem, RewardManager
from megatron_rl.rollout import Completion, RolloutConfig, RolloutEngine, SamplingSpec
from megatron_rl.trainer import routing_replay


@dataclass
class Rollout:
    """``len(records)`` prompts with ``group_size`` completions each, flattened group by group."""

    records: list[PromptRecord]
    completions: list[Completion]
    group_ids: torch.Tensor  # [B*n] index of the prompt each completion answers
    rewards: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    # The verifier's verdict per completion: {"status", "extracted", ...} (score fills it).
    outcomes: list[dict] | None = None
    # make_batch fills: every completion's advantage, and which ones the batch holds (in order).
    advantages: torch.Tensor | None = None
    batch_index: list[int] | None = None


def sampling_seed(run_seed: int, global_step: int) -> int:
    """Per-step sampling seed: a resumed run samples exactly what the uninterrupted run sampled."""
    return (run_seed * 1_000_003 + global_step * 7919) % (2**31 - 1)


def generate(engine: RolloutEngine, records: list[PromptRecord], r: RolloutConfig,
             max_response_len: int, seed: int) -> Rollout:
    """``r.group_size`` samples per prompt at the stage's max response length."""
    spec = SamplingSpec(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_tokens=max_response_len, seed=seed)
    groups = engine.generate([rec.prompt_ids for rec in records], spec)
    flat = [c for g in groups for c in g]
    gids = torch.tensor([i for i, g in enumerate(groups) for _ in g], dtype=torch.long)
    return Rollout(records=records, completions=flat, group_ids=gids,
                   truncated=torch.tensor([c.truncated for c in flat], dtype=torch.bool))


def reward_item(record: PromptRecord, response: str) -> RewardItem:
    """What the reward manager needs to score ``response`` to ``record``'s prompt."""
    return RewardItem(response=response, ground_truth=record.ground_truth, style=record.style,
                      extra={"question": record.prompt_text, "data_source": record.data_source,
                             "extra_info": record.extra})


def answer_text(c: Completion) -> str:
    """What the reward scores of a completion: the response, or a multi-turn trajectory's final
    answer (its environment's verdict; the model's last turn), never the tools' observations."""
    episode = c.extra.get("episode")
    return c.text if episode is None else episode["answer"]


def response_tokens(batch: SequenceBatch) -> float:
    """Trained response tokens in ``batch`` (tool observations excluded): the token-level loss's
    global denominator."""
    if LOSS_MASK not in batch.token_fields:
        return float(sum(len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens)))
    return float(sum(int(m.sum()) for m in batch.token_fields[LOSS_MASK]))


def score(reward_mgr: RewardManager, ro: Rollout) -> dict:
    items = [reward_item(ro.records[g], answer_text(c)) for c, g in zip(ro.completions, ro.group_ids.tolist())]
    scores, metrics, ro.outcomes = reward_mgr.score(items, return_details=True)
    ro.rewards = torch.tensor(scores, dtype=torch.float32)
    return metrics


def rollout_metrics(ro: Rollout, correct_reward: float) -> dict:
    lengths = torch.tensor([len(c.token_ids) for c in ro.completions], dtype=torch.float32)
    correct = ro.rewards >= correct_reward
    trunc = ro.truncated
    non_trunc = ~trunc
    return {
        "rollout/accuracy": correct.float().mean().item(),
        "rollout/accuracy_non_truncated": (correct & non_trunc).sum().item() / max(1, non_trunc.sum().item()),
        "rollout/truncation_ratio": trunc.float().mean().item(),
        "rollout/reward_mean": ro.rewards.mean().item(),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/response_length_min": lengths.min().item(),
        **episode_metrics(ro.completions, correct.tolist()),
    }


def make_batch(ro: Rollout, algo: AlgoConfig, max_response_len: int | None = None
               ) -> tuple[SequenceBatch | None, dict]:
    """Shape the rewards (``algo.shaping``; ``max_response_len``: the stage's), filter zero-variance
    groups, compute advantages, and lay the rollout out for the policy. Filtering and the
    advantages see the shaped rewards; the rollout keeps the verifier's (accuracy, dumps)."""
    lengths = torch.tensor([len(c.token_ids) for c in ro.completions], dtype=torch.float32)
    rewards, m_shape = ro.rewards, {}
    if algo.shaping.shapers:
        if max_response_len is None:
            raise ValueError("max_response_len: algo.shaping.shapers need the stage's max_response_len")
        rewards, m_shape = shape_rewards(ro.rewards, ro.group_ids, lengths, algo,
                                         max_response_len=max_response_len)
    adv, m_adv = compute_advantages(rewards, ro.group_ids, ro.truncated, algo, lengths=lengths)
    keep, m_filter = filter_groups(rewards, ro.group_ids, algo)  # all kept when filtering is off
    idx = keep.nonzero().flatten().tolist()
    ro.advantages, ro.batch_index = adv, idx
    metrics = {**m_shape, **m_adv, **m_filter, "batch/sequences": float(len(idx))}
    if not idx:
        return None, metrics
    comps = [ro.completions[i] for i in idx]
    recs = [ro.records[g] for g in ro.group_ids[idx].tolist()]
    token_fields = {"rollout_logp": [torch.tensor(c.logprobs, dtype=torch.float32) for c in comps],
                    # the weight version that sampled each token (async GRPO: older than the trainer's)
                    "weight_version": [torch.tensor(c.token_versions(), dtype=torch.long) for c in comps]}
    if any(c.loss_mask for c in comps):  # multi-turn trajectories: tool observations are not trained on
        token_fields[LOSS_MASK] = [torch.tensor(c.model_tokens(), dtype=torch.bool) for c in comps]
    batch = SequenceBatch(
        sequences=[list(r.prompt_ids) + list(c.token_ids) for r, c in zip(recs, comps)],
        prompt_lens=[len(r.prompt_ids) for r in recs],
        token_fields=token_fields,
        # rewards, groups and truncation travel along: algo.kl.as_reward recomputes the advantages
        seq_fields={"advantages": adv[idx].float(), "rewards": rewards[idx].float(),
                    "group_ids": ro.group_ids[idx], "truncated": ro.truncated[idx]},
    )
    if any(c.routes is not None for c in comps):  # MoE routing replay: the engine's routes travel along
        shape = next(c.routes for c in comps if c.routes is not None).shape[1:]
        batch.position_fields[routing_replay.ENGINE] = [
            routing_replay.engine_routes(c.routes, len(seq), f"completion {i} of the batch ({c.engine})",
                                         untrained=None if any(c.model_tokens()) else shape)
            for i, (c, seq) in enumerate(zip(comps, batch.sequences))]
    metrics["batch/tokens"] = float(sum(len(c.token_ids) for c in comps))
    return batch, metrics


def reference_solution(record: PromptRecord) -> str | list[dict]:
    """The solution SFT trains on (``solution`` in the record's extra fields): a string, or a
    demonstrated multi-turn trajectory (a list of assistant and tool messages, the last an
    assistant's); ValueError without one."""
    sol = record.extra.get("solution") if isinstance(record.extra, dict) else None
    if isinstance(sol, list):
        problem = check_messages(sol)
        if problem:
            raise ValueError(f"the reference solution of prompt {record.uid!r} (a list: a demonstrated "
                             f"trajectory): {problem}")
        return sol
    if not isinstance(sol, str):
        raise ValueError(f"SFT needs a reference solution (a string 'solution' in the row's extra fields, "
                         f"data.extra_key, or a list of assistant / tool messages) for prompt {record.uid!r}, "
                         f"got {sol!r}")
    return sol


@functools.lru_cache(maxsize=4)
def _renderer(tokenizer) -> TurnRenderer:
    return TurnRenderer(tokenizer)


def demonstration(record: PromptRecord, tokenizer) -> tuple[list[int], list[int]]:
    """The response SFT trains on and its loss mask: the reference solution, tokenized, + EOS (all
    trained); a demonstrated trajectory as the rollout would lay it out (each assistant turn + EOS
    trained, each tool message rendered by the chat template and not trained)."""
    sol = reference_solution(record)
    if isinstance(sol, list):
        return _renderer(tokenizer).demonstration(sol)
    ids = tokenizer(sol, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids, [1] * len(ids)


def demonstration_ids(record: PromptRecord, tokenizer) -> list[int]:
    """The response tokens SFT trains on (see :func:`demonstration`)."""
    return demonstration(record, tokenizer)[0]


def sft_batch(records: list[PromptRecord], tokenizer) -> SequenceBatch:
    """Prompts + reference solutions (+ EOS), advantage 1: SFT through the GRPO objective (SFT is RL
    with every sample positive). Tool messages of demonstrated trajectories are not trained on."""
    seqs, plens, masks = [], [], []
    for r in records:
        ids, mask = demonstration(r, tokenizer)
        seqs.append(list(r.prompt_ids) + ids)
        plens.append(len(r.prompt_ids))
        masks.append(torch.tensor(mask, dtype=torch.bool))
    fields = {LOSS_MASK: masks} if not all(bool(m.all()) for m in masks) else {}
    return SequenceBatch(sequences=seqs, prompt_lens=plens, token_fields=fields,
                         seq_fields={"advantages": torch.ones(len(seqs))})


def sft_objective(algo: AlgoConfig) -> AlgoConfig:
    """The objective the SFT cold start trains with: the run's aggregation and entropy settings with
    the plain policy gradient (``reinforce``: at ratio 1 with advantage 1 every registered loss has
    the NLL's gradient) and none of the terms that need a rollout (the engine's log-probs for a
    mismatch correction or decoupled PPO, the KL reference, the distillation teacher, token masks),
    which SFT's demonstrations do not have."""
    return dataclasses.replace(algo, policy_loss="reinforce", clip=dataclasses.replace(algo.clip, dual_clip_c=None),
                               mismatch=type(algo.mismatch)(), kl=type(algo.kl)(), distill=type(algo.distill)(),
                               token_mask=type(algo.token_mask)())


def kl_shaped_advantages(batch: SequenceBatch, algo: AlgoConfig) -> dict:
    """``algo.kl.as_reward``: each response's reward minus ``coef`` x its summed token KL(old || ref)
    (``algo.kl_reward_penalty``), and the advantages recomputed from those rewards within the kept
    groups; needs the batch's ``old_logp`` and ``ref_logp``."""
    width = max(batch.response_lens)
    padded = pad_token_fields(batch, list(range(len(batch))), width)
    mask = torch.arange(width)[None, :] < torch.tensor(batch.response_lens)[:, None]
    if LOSS_MASK in padded:  # a tool's observation tokens are no action of the policy: no KL there
        mask &= padded[LOSS_MASK]
    penalty, metrics = kl_reward_penalty(padded["old_logp"], padded["ref_logp"], mask, algo)
    f = batch.seq_fields
    adv, m_adv = compute_advantages(f["rewards"] - penalty.to(f["rewards"].dtype), f["group_ids"],
                                    f["truncated"], algo,
                                    lengths=torch.tensor(batch.response_lens, dtype=torch.float32))
    f["advantages"] = adv.float()
    return {**metrics, **m_adv}


def optimizer_steps(batch: SequenceBatch, algo: AlgoConfig, seed: int
                    ) -> list[tuple[torch.Tensor, SequenceBatch]]:
    """``(indices into batch, mini-batch)`` of every optimizer step: ``algo.n_sgd`` passes of
    ``algo.mini_batches`` steps, each pass a fresh seeded shuffle (``algo.sgd_schedule``); strictly
    on-policy, the whole batch."""
    steps = min(algo.mini_batches, len(batch))  # zero-variance filtering may leave fewer sequences
    if steps != algo.mini_batches:
        algo = dataclasses.replace(algo, mini_batches=steps)
    return [(index, batch.select(index)) for index in sgd_schedule(len(batch), algo, seed=seed)]


def make_loss_fn(batch: SequenceBatch, algo: AlgoConfig, *, alpha: float, max_response_len: int | None):
    """The per-micro-batch objective with the mini-batch's global denominators bound in."""
    n_tokens = response_tokens(batch)
    n_seqs = float(len(batch.sequences))

    def loss_fn(mb: MicroBatch):
        old = mb.fields.get("old_logp")
        # Strictly on-policy without a recompute: the old policy IS the current one (ratio = 1).
        old = mb.logp.detach() if old is None else old
        return policy_objective(
            mb.logp, old, mb.fields["advantages"], mb.mask, algo, entropy=mb.entropy, alpha=alpha,
            rollout_logp=mb.fields.get("rollout_logp"), ref_logp=mb.fields.get("ref_logp"),
            teacher_logp=mb.fields.get("teacher_logp"), token_mask=mb.fields.get("token_mask"),
            token_denominator=n_tokens, seq_denominator=n_seqs, max_response_len=max_response_len)

    return loss_fn


# What the training forward reports per sample for the rollout dumps (see sample_stats).
SAMPLE_STATS = ("entropy_mean", "entropy_max", "train_logp_mean", "logp_gap_mean", "logp_gap_max")


def sample_stats(mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Per sequence of a training micro-batch: token entropy (mean, max), the trainer's sampled-token
    log-prob before the update (the recomputed old log-probs when there are, else this forward's),
    and its gap to the engine's (mean and max of |trainer - engine|)."""
    m = mb.mask
    n = m.sum(1).clamp(min=1)
    ref = mb.fields.get("old_logp", mb.logp).detach()
    gap = (ref - mb.fields["rollout_logp"]).abs().masked_fill(~m, 0.0)
    out = {"train_logp_mean": (ref.masked_fill(~m, 0.0)).sum(1) / n,
           "logp_gap_mean": gap.sum(1) / n, "logp_gap_max": gap.max(1).values}
    if mb.entropy is not None:
        ent = mb.entropy.detach()
        out["entropy_mean"] = ent.masked_fill(~m, 0.0).sum(1) / n
        out["entropy_max"] = ent.masked_fill(~m, float("-inf")).max(1).values
    else:
        out["entropy_mean"] = out["entropy_max"] = torch.full_like(n, float("nan"), dtype=torch.float32)
    return out
