"""The GRPO loop. One step reads top-down as the phases of DESIGN.md's step walk; each phase is a call."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from megatron_rl.tracking.console import StageProgress
from megatron_rl.trainer import phases
from megatron_rl.trainer.checkpointing import begin_stage, finish_stage, save_checkpoint
from megatron_rl.trainer.evaluate import evaluate, sync_weights
from megatron_rl.trainer.state import RunDir

log = logging.getLogger("megatron_rl")


class StepTimer:
    """Wall-clock split of a step: gen / reward / logprob / update / sync, and the rest as 'other'."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.parts: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t

    def metrics(self) -> dict:
        total = time.perf_counter() - self.t0
        out = {f"timing/{k}": v for k, v in self.parts.items()}
        out["timing/other"] = total - sum(self.parts.values())
        out["timing/step"] = total
        return out


def train_stage(ctx, stage) -> None:
    cfg = ctx.cfg
    state, loader = begin_stage(ctx, stage)
    with StageProgress(stage.name, stage.max_steps, state.step, enabled=ctx.is_driver and cfg.tracking.console) as bar:
        run_steps(ctx, stage, state, loader, bar)
    if ctx.stop_agreed() and state.step < stage.max_steps:
        if not RunDir.is_complete(ctx.run.step_dir(stage.name, state.step)):  # not just saved periodically
            save_checkpoint(ctx, stage, state, loader)
        return
    finish_stage(ctx, stage, state, loader)


def run_steps(ctx, stage, state, loader, bar) -> None:
    cfg = ctx.cfg
    while state.step < stage.max_steps and not ctx.stop_agreed():
        timer = StepTimer()
        metrics: dict = {}
        batch = None
        if ctx.is_driver:
            records = loader.next_batch()
            with timer("gen"):
                ro = phases.generate(ctx.engine, records, cfg, stage.max_response_len,
                                     seed=phases.sampling_seed(cfg.trainer.seed, state.global_step))
            with timer("reward"):
                metrics.update(phases.score(ctx.reward_mgr, ro))
            metrics.update(phases.rollout_metrics(ro, cfg.algo.correct_reward))
            batch, m = phases.make_batch(ro, cfg)
            metrics.update(m)
        batch = ctx.broadcast(batch)
        if batch is not None:
            with timer("logprob"):
                metrics.update(add_old_logprobs(ctx, batch))
            with timer("update"):
                metrics.update(update_policy(ctx, batch, stage))
            with timer("sync"):
                state.weight_version += 1
                metrics.update(sync_weights(ctx, state.weight_version))
        else:
            log.warning("step %d: every group had zero reward variance; no update", state.step)
        state.step += 1
        state.global_step += 1
        metrics.update(ctx.entropy_ctl.update(metrics["actor/entropy"]) if "actor/entropy" in metrics else {})
        metrics["actor/entropy_coef"] = ctx.entropy_ctl.alpha
        metrics.update(timer.metrics())
        state.grpo_seconds += metrics["timing/step"]
        if cfg.eval.every and state.step % cfg.eval.every == 0 and state.step < stage.max_steps:
            metrics.update(evaluate(ctx, stage.max_response_len))
        if ctx.is_driver:
            ctx.tracker.log(metrics, step=state.global_step, stage=stage.name)
            bar.advance(state.step, metrics)
        stop = plateaued(state, stage, ctx.broadcast(metrics.get("eval/accuracy")))
        if cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0:
            save_checkpoint(ctx, stage, state, loader)
        if stop:
            log.info("stage %s: validation accuracy plateaued at step %d", stage.name, state.step)
            break


def add_old_logprobs(ctx, batch) -> dict:
    """Old-policy log-probs recomputed by the trainer at the sampling temperature (DESIGN step 4).

    Strictly on-policy (one pass, one mini-batch, no mismatch correction) the old policy is the
    current one, so the recompute is skipped and the loss uses the training forward's log-probs.
    """
    a = ctx.cfg.algo
    if a.n_sgd == 1 and a.mini_batches == 1 and a.mismatch.mode == "none":
        return {}
    logp, _ = ctx.policy.compute_logprobs(batch, ctx.cfg.rollout.temperature, with_entropy=False)
    batch.token_fields["old_logp"] = logp
    gap = [(lp - rl).abs().mean().item() for lp, rl in zip(logp, batch.token_fields["rollout_logp"])]
    return {"rollout/train_infer_logp_gap": sum(gap) / max(1, len(gap))}


def update_policy(ctx, batch, stage) -> dict:
    """``n_sgd`` passes over the batch, ``mini_batches`` optimizer steps per pass; metrics averaged."""
    a = ctx.cfg.algo
    with_entropy = True  # entropy is always measured (metrics, entropy control); its grad only if used
    totals: dict[str, float] = {}
    n = 0
    for _ in range(a.n_sgd):
        for mb in phases.split(batch, a.mini_batches):
            loss_fn = phases.make_loss_fn(mb, ctx.cfg, alpha=ctx.entropy_ctl.alpha,
                                          max_response_len=stage.max_response_len)
            m = ctx.policy.train_step(mb, loss_fn, temperature=ctx.cfg.rollout.temperature,
                                      with_entropy=with_entropy)
            for k, v in m.items():
                if k.endswith("_min"):
                    totals[k] = min(totals.get(k, v), v)
                elif k.endswith("_max"):
                    totals[k] = max(totals.get(k, v), v)
                else:
                    totals[k] = totals.get(k, 0.0) + v
            n += 1
    return {k: v if k.endswith(("_min", "_max")) else v / n for k, v in totals.items()}


def plateaued(state, stage, accuracy) -> bool:
    """The plateau rule: no improvement above ``min_delta`` for ``patience`` evaluations."""
    p = stage.plateau
    if accuracy is None:
        return False
    if accuracy > state.best_eval_accuracy + p.min_delta:
        state.best_eval_accuracy = accuracy
        state.evals_without_improvement = 0
        return False
    state.evals_without_improvement += 1
    return bool(p.patience) and state.evals_without_improvement >= p.patience
