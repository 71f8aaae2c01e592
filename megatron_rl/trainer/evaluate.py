"""Greedy held-out evaluation, and pushing the policy's weights into the engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megatron_rl.data import PromptRecord
from megatron_rl.envs.metrics import episode_metrics
from megatron_rl.rollout import SamplingSpec
from megatron_rl.tracking.progress import Phase
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.phases import answer_text, reward_item

log = logging.getLogger("megatron_rl")


def sync_weights(ctx: Context, version: int) -> dict:
    """Trainer weights -> engines (every rank takes part in the collective export). A sync that left
    some reachable engine without the new weights (another died mid-transfer, a checksum differed)
    runs again with a fresh export, up to ``sync.retries`` times; rank 0 decides for all ranks. With
    ``sync.verify`` every engine must then score the probe sequence as the trainer does
    (:func:`probe_reference`; an engine that does not is out until a later sync passes)."""
    ctx.engines_wake()  # colocated on GPUs: the engines need their memory to load the weights
    if ctx.cfg.sync.verify:
        reference = probe_reference(ctx)  # collective: every rank takes part in the forward
        if ctx.is_driver:
            ctx.weight_sync.set_probe(reference)
    seconds = 0.0
    for attempt in range(ctx.cfg.sync.retries + 1):
        stream = ctx.policy.export_owned(ctx.export_plan, placeholders=ctx.weight_sync.placeholders)
        m = ctx.weight_sync.sync(stream, version)
        seconds += m.seconds
        if ctx.broadcast(m.complete if ctx.is_driver else None):
            break
        log.warning("weight sync v%d: %s; syncing again (%d of %d)", version, m.failures, attempt + 1,
                    ctx.cfg.sync.retries)
    out = m.as_dict()
    out["sync/seconds"] = seconds
    out["sync/attempts"] = float(attempt + 1)
    return out


def probe_reference(ctx: Context):
    """The trainer's log-probs of the fixed probe sequence (``megatron_rl.sync.probe``) with the
    weights about to be sent; the sync compares every engine's with them. Collective."""
    from megatron_rl.models.batch import SequenceBatch
    from megatron_rl.sync import probe
    from megatron_rl.trainer.schema import max_sequence_len

    cfg = ctx.cfg
    tokens = probe.probe_tokens(min(len(ctx.tokenizer), ctx.policy.arch.vocab_size),
                                probe.probe_length(max_sequence_len(cfg)))
    (mine,), _ = ctx.policy.compute_logprobs(SequenceBatch(sequences=[tokens], prompt_lens=[1]), 1.0,
                                             with_entropy=False)
    tolerance = cfg.sync.probe_tolerance or probe.default_tolerance(cfg.rollout.dtype)
    return probe.ProbeReference(tokens=tokens, logprobs=[float(x) for x in mine.tolist()], tolerance=tolerance)


def record_eval(ctx: Context, key: str, max_tokens: int) -> dict:
    """:func:`evaluate`, kept in the run state under ``key`` (``start``, a stage's name), every
    answer in ``RUN_DIR/eval/<key>.jsonl``."""
    with Phase(f"evaluation [{key}]", kind="eval", work=len(ctx.eval_records),
               enabled=ctx.is_driver and ctx.cfg.tracking.console):
        m = evaluate(ctx, max_tokens, answers=ctx.run.root / "eval" / f"{key}.jsonl")
    if ctx.is_driver and m:
        rs = ctx.run.read_run_state()
        rs.setdefault("eval", {})[key] = m
        ctx.run.write_run_state(rs)
        log.info("eval [%s]: accuracy %.3f on %d held-out problems", key, m["eval/accuracy"], int(m["eval/n"]))
    return m


def evaluate(ctx: Context, max_tokens: int, records: list[PromptRecord] | None = None,
             prefix: str = "eval", answers: Path | None = None) -> dict:
    """Greedy accuracy on the held-out set (driver only; other ranks return {}). ``answers``: a
    JSONL file that gets every problem's row, response and score."""
    if not ctx.is_driver:
        return {}
    records = ctx.eval_records if records is None else records
    if not records:
        return {}
    ctx.engines_wake()
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=ctx.cfg.rollout.eval_max_tokens or max_tokens)
    if ctx.envs is not None:  # prompts with an environment: greedy multi-turn trajectories, with tools
        from megatron_rl.rollout.multi_turn import generate as generate_trajectories

        outs = [g[0] for g in generate_trajectories(ctx.engine, ctx.envs, records, spec)]
    else:
        outs = [g[0] for g in ctx.engine.generate([r.prompt_ids for r in records], spec)]
    items = [reward_item(r, answer_text(o)) for o, r in zip(outs, records)]
    scores, _ = ctx.reward_mgr.score(items)
    correct = torch.tensor(scores) >= ctx.cfg.algo.correct_reward
    trunc = torch.tensor([o.truncated for o in outs])
    if answers is not None:
        answers.parent.mkdir(parents=True, exist_ok=True)
        with open(answers, "w") as f:
            for r, o, sc in zip(records, outs, scores):
                row = {"row": r.row, "uid": r.uid, "response": o.text, "score": sc,
                       "weight_version": o.weight_version}
                if "episode" in o.extra:  # a multi-turn trajectory: its turns and tool calls
                    row["episode"] = o.extra["episode"]
                f.write(json.dumps(row) + "\n")
    out = {
        f"{prefix}/accuracy": correct.float().mean().item(),
        f"{prefix}/truncation_ratio": trunc.float().mean().item(),
        f"{prefix}/response_length_mean": sum(len(o.token_ids) for o in outs) / len(outs),
        f"{prefix}/n": float(len(outs)),
    }
    # the multi-turn metrics of the evaluation (tool use, accuracy with vs without a tool call)
    out.update({f"{prefix}/{k.split('/', 1)[1]}": v for k, v in episode_metrics(outs, correct.tolist()).items()})
    return out
