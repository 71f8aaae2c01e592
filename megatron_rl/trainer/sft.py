"""SFT cold start: the GRPO objective with advantage 1 on reference solutions (seed 002).

Stops on held-out accuracy, checked at a fine grain, not on a time budget (DESIGN.md: the jump from
a few percent to most problems solved can happen within 15 s; a cold start that overshoots leaves RL
nothing to learn). The stop check uses a validation slice of the *training* problems, so the
evaluation set stays untouched until it measures the result.
"""

from __future__ import annotations

import logging
import time

from megatron_rl.data import PromptLoader
from megatron_rl.trainer import phases
from megatron_rl.trainer.checkpointing import _write
from megatron_rl.trainer.evaluate import evaluate, sync_weights
from megatron_rl.trainer.state import TrainerState

log = logging.getLogger("megatron_rl")


def run_sft(ctx) -> None:
    cfg, s = ctx.cfg, ctx.cfg.sft
    rs = ctx.run.read_run_state() if ctx.is_driver else {}
    if ctx.broadcast(rs.get("sft_done", False)):
        return
    loader = val = None
    if ctx.is_driver:
        val = ctx.train_records[-s.eval_size:]
        loader = PromptLoader(ctx.train_records[: -s.eval_size], s.batch_size, seed=cfg.trainer.seed + 1)
    lr = s.lr
    ctx.policy.set_lr(lr)
    state = TrainerState(stage="sft")
    t0 = time.perf_counter()
    for step in range(1, s.max_steps + 1):
        if ctx.stop_agreed():  # a signal: leave; the cold start restarts when the job is requeued
            return
        batch = ctx.broadcast(phases.sft_batch(loader.next_batch(), ctx.tokenizer) if ctx.is_driver else None)
        loss_fn = with_nll(phases.make_loss_fn(batch, cfg, alpha=0.0, max_response_len=None), batch)
        m = ctx.policy.train_step(batch, loss_fn, temperature=1.0, with_entropy=True)
        state.step = state.global_step = step
        done = s.max_seconds and time.perf_counter() - t0 > s.max_seconds
        if step % s.eval_every == 0 or done or step == s.max_steps:
            state.weight_version += 1
            sync_weights(ctx, state.weight_version)
            m.update(evaluate(ctx, cfg.stages[0].max_response_len, records=val, prefix="sft_val"))
            acc = ctx.broadcast(m.get("sft_val/accuracy", 0.0))
            if acc >= s.slow_down_at and lr == s.lr:
                lr = s.lr * s.slow_down_factor
                ctx.policy.set_lr(lr)
            if acc >= s.stop_accuracy:
                done = True
        if ctx.is_driver:
            ctx.tracker.log({**m, "sft/lr": lr, "sft/seconds": time.perf_counter() - t0}, step=step, stage="sft")
            if "sft_val/accuracy" in m:
                log.info("[sft %d] nll=%.4f val_acc=%.3f lr=%.2g", step, m.get("sft/nll", float("nan")),
                         m["sft_val/accuracy"], lr)
        if done:
            break
    ctx.policy.set_lr(cfg.policy.optim.lr)
    final = ctx.run.final_dir("sft")
    _write(ctx, final, state, None)
    if ctx.is_driver:
        ctx.run.write_run_state({**ctx.run.read_run_state(), "sft_done": True, "sft_steps": state.step,
                                 "sft_seconds": time.perf_counter() - t0})
        log.info("sft: done after %d steps (%.0f s)", state.step, time.perf_counter() - t0)


def with_nll(loss_fn, batch):
    """Add the token-mean negative log-likelihood to the metrics (the SFT objective's value; the
    policy loss itself reads -A·ratio = -1 when ratio = 1 and A = 1)."""
    n_tokens = float(sum(len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens)))

    def wrapped(mb):
        loss, metrics = loss_fn(mb)
        nll = -(mb.logp.detach() * mb.mask).sum().item() / n_tokens
        return loss, {**metrics, "sft/nll": nll}

    return wrapped
