"""SFT cold start: the GRPO objective with advantage 1 on reference solutions (SFT is RL with every
sample positive).

Stops on held-out accuracy, checked at a fine grain, not on a time budget (measured on the demo's
task: the jump from a few percent to most problems solved can happen within 15 s; a cold start that
overshoots leaves RL nothing to learn). The stop check uses a validation slice of the *training*
problems, so the evaluation set stays untouched until it measures the result.
"""

from __future__ import annotations

import itertools
import logging
import time

from megatron_rl.data import PromptLoader
from megatron_rl.tracking.progress import Phase
from megatron_rl.trainer import phases
from megatron_rl.trainer.checkpointing import write_checkpoint
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.evaluate import evaluate, sync_weights
from megatron_rl.trainer.state import TrainerState

log = logging.getLogger("megatron_rl")

# The control experiment's weight versions start here: above every version the cold start and the
# GRPO stages gave out, so an engine never sees a version twice for different weights.
CONTROL_WEIGHT_VERSION_BASE = 10**6
# A stop accuracy no run reaches: the control experiment stops on the clock only.
UNREACHABLE_ACCURACY = 2.0


def run_sft(ctx: Context) -> None:
    """The cold start (once per run): SFT until the validation slice reaches ``sft.stop_accuracy``."""
    s = ctx.cfg.sft
    rs = ctx.run.read_run_state() if ctx.is_driver else {}
    if ctx.broadcast(rs.get("sft_done", False)):
        return
    t0 = time.perf_counter()
    state, lr = sft_loop(ctx, "sft", lr=s.lr, stop_accuracy=s.stop_accuracy, max_seconds=s.max_seconds,
                         max_steps=s.max_steps, step_offset=0, slow_down=True)
    if state is None:  # stopped by a signal
        return
    ctx.policy.set_lr(ctx.cfg.policy.optim.lr)
    write_checkpoint(ctx, ctx.run.final_dir("sft"), state, None)
    if ctx.is_driver:
        ctx.run.write_run_state({**ctx.run.read_run_state(), "sft_done": True, "sft_steps": state.step,
                                 "sft_seconds": time.perf_counter() - t0, "sft_final_lr": lr})
        log.info("sft: done after %d steps (%.0f s)", state.step, time.perf_counter() - t0)


def run_sft_control(ctx: Context, seconds: float, step_offset: int) -> dict:
    """The control experiment: from the cold start's checkpoint, spend the same
    wall time the GRPO stages took on *more SFT* (at the cold start's final learning rate), then
    measure greedy held-out accuracy. Set beside the GRPO gain, it tells how much RL itself added."""
    ctx.policy.load_checkpoint(str(ctx.run.final_dir("sft") / "policy"))
    lr = ctx.broadcast(ctx.run.read_run_state().get("sft_final_lr", ctx.cfg.sft.lr) if ctx.is_driver else None)
    state, _ = sft_loop(ctx, "sft_control", lr=lr, stop_accuracy=UNREACHABLE_ACCURACY, max_seconds=seconds,
                        max_steps=None, step_offset=step_offset, slow_down=False)
    if state is None:
        return {}
    sync_weights(ctx, CONTROL_WEIGHT_VERSION_BASE + state.step)
    m = evaluate(ctx, ctx.cfg.stages[-1].max_response_len)
    return {"control/accuracy": m.get("eval/accuracy"), "control/sft_steps": state.step,
            "control/seconds": seconds}


def sft_loop(ctx: Context, name: str, *, lr: float, stop_accuracy: float, max_seconds: float,
             max_steps: int | None, step_offset: int, slow_down: bool):
    """SFT steps until the validation slice reaches ``stop_accuracy``, the clock or the step cap
    (``max_steps=None``: no cap). Returns (state, final lr), or (None, lr) when a signal asked the
    run to stop."""
    cfg, s = ctx.cfg, ctx.cfg.sft
    loader = val = None
    if ctx.is_driver:
        val = ctx.sft_records[-s.eval_size:]
        loader = PromptLoader(ctx.sft_records[: -s.eval_size], s.batch_size, seed=cfg.trainer.seed + 1)
    ctx.policy.set_lr(lr)
    state = TrainerState(stage=name)
    t0 = time.perf_counter()
    with Phase(f"{name} (until val acc {stop_accuracy:g})" if stop_accuracy <= 1 else name, total=max_steps,
               unit="steps", at_most=True, max_seconds=max_seconds,
               enabled=ctx.is_driver and cfg.tracking.console) as bar:
        for step in itertools.count(1) if max_steps is None else range(1, max_steps + 1):
            if ctx.stop_agreed():  # a signal: leave; SFT restarts from its start when the job is requeued
                return None, lr
            batch = ctx.broadcast(phases.sft_batch(loader.next_batch(), ctx.tokenizer) if ctx.is_driver else None)
            loss_fn = with_nll(phases.make_loss_fn(batch, phases.sft_objective(cfg.algo), alpha=0.0,
                                                   max_response_len=None), batch)
            m = ctx.policy.train_step(batch, loss_fn, temperature=1.0, with_entropy=True)
            state.step = state.global_step = step
            bar.update(step)
            done = bool(max_seconds) and ctx.broadcast(time.perf_counter() - t0 > max_seconds)
            if step % s.eval_every == 0 or done or step == max_steps:
                state.weight_version += 1
                sync_weights(ctx, state.weight_version)
                m.update(evaluate(ctx, cfg.stages[0].max_response_len, records=val, prefix=f"{name}_val"))
                acc = ctx.broadcast(m.get(f"{name}_val/accuracy", 0.0))
                if slow_down and acc >= s.slow_down_at and lr == s.lr:
                    lr = s.lr * s.slow_down_factor
                    ctx.policy.set_lr(lr)
                done = done or acc >= stop_accuracy
            if ctx.is_driver:
                ctx.tracker.log({**m, f"{name}/lr": lr, f"{name}/seconds": time.perf_counter() - t0},
                                step=step_offset + step, stage=name)
                if f"{name}_val/accuracy" in m:
                    log.info("[%s %d] nll=%.4f val_acc=%.3f lr=%.2g", name, step, m.get("sft/nll", float("nan")),
                             m[f"{name}_val/accuracy"], lr)
            if done:
                break
    return state, lr


def with_nll(loss_fn, batch):
    """Add the token-mean negative log-likelihood to the metrics (the SFT objective's value; the
    policy loss itself reads -A·ratio = -1 when ratio = 1 and A = 1)."""
    n_tokens = phases.response_tokens(batch)

    def wrapped(mb):
        loss, metrics = loss_fn(mb)
        nll = -(mb.logp.detach() * mb.mask).sum().item() / n_tokens
        return loss, {**metrics, "sft/nll": nll}

    return wrapped
