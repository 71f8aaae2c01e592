"""Greedy held-out evaluation, and pushing the policy's weights into the engine."""

from __future__ import annotations

import torch

from megatron_rl.data import PromptRecord
from megatron_rl.rollout import SamplingSpec
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.phases import reward_item


def sync_weights(ctx: Context, version: int) -> dict:
    """Trainer weights -> engine (every rank drains the collective export iterator), then, with
    ``sync.verify``, :func:`verify_probe`."""
    m = ctx.weight_sync.sync(ctx.policy.export_hf_weights(), version)
    metrics = m.as_dict() if hasattr(m, "as_dict") else dict(m)
    if ctx.cfg.sync.verify:
        metrics.update(verify_probe(ctx))
    return metrics


def verify_probe(ctx: Context) -> dict:
    """Every engine's log-probs of the fixed probe sequence against the trainer's own
    (``megatron_rl.sync.probe``); raises SyncMismatch naming the engine past the tolerance.
    Collective: every rank takes part in the trainer's forward."""
    from megatron_rl.models.batch import SequenceBatch
    from megatron_rl.sync import probe

    tokens = probe.probe_tokens(min(len(ctx.tokenizer), ctx.policy.arch.vocab_size),
                                min(probe.PROBE_LEN, ctx.cfg.engine_context_len() - 1))  # + 1 sampled
    (mine,), _ = ctx.policy.compute_logprobs(SequenceBatch(sequences=[tokens], prompt_lens=[1]), 1.0,
                                             with_entropy=False)
    if not ctx.is_driver:
        return {}
    cfg = ctx.cfg
    tolerance = cfg.sync.probe_tolerance or probe.default_tolerance(cfg.rollout.dtype)
    gaps = [probe.compare(getattr(engine, "name", f"engine{i}"), engine.score(tokens), mine.tolist(),
                          tolerance) for i, engine in enumerate(ctx.engines)]
    return {"sync/probe_gap_mean": max(g["mean"] for g in gaps),
            "sync/probe_gap_max": max(g["max"] for g in gaps)}


def evaluate(ctx: Context, max_tokens: int, records: list[PromptRecord] | None = None,
             prefix: str = "eval") -> dict:
    """Greedy accuracy on the held-out set (driver only; other ranks return {})."""
    if not ctx.is_driver:
        return {}
    records = ctx.eval_records if records is None else records
    if not records:
        return {}
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=ctx.cfg.rollout.eval_max_tokens or max_tokens)
    outs = [g[0] for g in ctx.engine.generate([r.prompt_ids for r in records], spec)]
    items = [reward_item(r, o.text) for o, r in zip(outs, records)]
    scores, _ = ctx.reward_mgr.score(items)
    correct = torch.tensor(scores) >= ctx.cfg.algo.correct_reward
    trunc = torch.tensor([o.truncated for o in outs])
    return {
        f"{prefix}/accuracy": correct.float().mean().item(),
        f"{prefix}/truncation_ratio": trunc.float().mean().item(),
        f"{prefix}/response_length_mean": sum(len(o.token_ids) for o in outs) / len(outs),
        f"{prefix}/n": float(len(outs)),
    }
