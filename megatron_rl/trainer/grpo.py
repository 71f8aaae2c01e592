"""The GRPO loop. One step reads top-down as its phases (docs/architecture.md's step walk); each
phase is a call."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron_rl.algo import AlgoConfig, token_masks
from megatron_rl.common.metrics import reduce_metrics
from megatron_rl.models.batch import PerSequence, SequenceBatch
from megatron_rl.tracking.console import StageProgress
from megatron_rl.trainer import phases
from megatron_rl.trainer.async_rollout import Interrupted, RolloutScheduler, open_rollouts
from megatron_rl.trainer.checkpointing import begin_stage, ensure_reference, finish_stage, save_checkpoint
from megatron_rl.trainer.config import StageConfig
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.evaluate import evaluate, record_eval, sync_weights
from megatron_rl.trainer.no_update import NoUpdateStop, NoUpdateWatch, no_update_reason
from megatron_rl.trainer.routing_replay import StepRouting
from megatron_rl.trainer.state import RunDir, TrainerState
from megatron_rl.trainer.teacher import ensure_teacher

if TYPE_CHECKING:
    from megatron_rl.data import PromptLoader
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy

log = logging.getLogger("megatron_rl")

# What the driver broadcasts instead of a batch when a stop request interrupted the step's generation.
INTERRUPTED = "interrupted"


class StepTimer:
    """Wall-clock split of a step: gen / reward / logprob / update / sync / dump, the rest as 'other'."""

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


def train_stage(ctx: Context, stage: StageConfig, *, eval_start: bool = False) -> None:
    """One stage, from where it starts (or resumes); ``eval_start``: first the held-out evaluation
    of the weights it starts from (the run's ``start``)."""
    cfg = ctx.cfg
    ensure_reference(ctx)
    ensure_teacher(ctx)
    state, loader = begin_stage(ctx, stage)  # the engines now hold the weights it starts from
    if eval_start:
        record_eval(ctx, "start", stage.max_response_len)
    rollouts = open_rollouts(ctx, stage, state, loader)  # the driver's source of rollouts (rollout.async)
    try:
        with StageProgress(stage.name, stage.max_steps, state.step, enabled=ctx.is_driver and cfg.tracking.console) as bar:
            interrupted = run_steps(ctx, stage, state, loader, rollouts, bar)
        if ctx.is_driver and ctx.observer is not None:
            ctx.observer.flush()
        if ctx.stop_agreed() and state.step < stage.max_steps:
            # (again after an interrupted step: the checkpoint then keeps what it generated)
            if interrupted or not RunDir.is_complete(ctx.run.step_dir(stage.name, state.step)):
                save_checkpoint(ctx, stage, state, loader, rollouts)
            return
    finally:
        if rollouts is not None:
            rollouts.close()
    finish_stage(ctx, stage, state, loader)


def run_steps(ctx: Context, stage: StageConfig, state: TrainerState, loader: PromptLoader | None,
              rollouts: RolloutScheduler | None, bar: StageProgress) -> bool:
    """The stage's steps until its end or a stop; True when a stop request interrupted a step's
    generation (preemption: nothing of that step was trained, what it generated is kept)."""
    cfg = ctx.cfg
    watch = NoUpdateWatch(cfg.trainer.max_steps_without_update)
    while state.step < stage.max_steps and not ctx.stop_agreed():
        timer = StepTimer()
        metrics: dict = {}
        batch = None
        sample = ""
        if ctx.is_driver:  # generate + score (timed "gen" / "reward"), as soon as rollout.async allows
            ctx.engines_wake()
            try:
                ro, m = rollouts.next_rollout(state.step, state.global_step, state.weight_version, timer,
                                              stop=lambda: ctx.stop.requested)
            except Interrupted as exc:
                log.warning("stage %s: %s: the step is given up, what it generated is kept", stage.name, exc)
                ro, m, batch = None, {}, INTERRUPTED
            if not cfg.rollout.async_.enabled:  # colocated on GPUs: nothing generates while training
                ctx.engines_sleep()
            m.update(ctx.engine.pop_metrics())  # the fleet's re-sent requests, engines up / down
            metrics.update(m)
            if ro is not None:
                metrics.update(phases.rollout_metrics(ro, cfg.algo.correct_reward))
                batch, m = phases.make_batch(ro, cfg.algo, stage.max_response_len)
                metrics.update(m)
                sample = (f"{ro.completions[0].text[:300]!r} (ground truth "
                          f"{ro.records[0].ground_truth!r})")
        batch = ctx.broadcast(batch)
        if isinstance(batch, str):  # INTERRUPTED: every rank leaves the step
            ctx.stop.requested = True  # (so that every rank agrees to stop)
            return True
        per_sample = None
        if batch is not None:
            with timer("logprob"):
                metrics.update(add_logprobs(ctx.policy, ctx.reference, batch, cfg.algo,
                                            cfg.rollout.temperature, state.weight_version,
                                            teacher=ctx.teacher))
            with timer("update"):
                m, per_sample = update_policy(
                    ctx.policy, batch, cfg.algo, cfg.rollout.temperature, alpha=ctx.entropy_ctl.alpha,
                    max_response_len=stage.max_response_len,
                    seed=phases.sampling_seed(cfg.trainer.seed, state.global_step),
                    version=state.weight_version)
                metrics.update(m)
            with timer("sync"):
                metrics.update(rollouts.before_sync() if rollouts is not None else {})
                state.weight_version += 1
                metrics.update(sync_weights(ctx, state.weight_version))
                if rollouts is not None:
                    rollouts.after_sync()
        note = "" if batch is not None else no_update_reason(metrics)
        watch.record(batch is not None, metrics, sample)
        if ctx.is_driver and ctx.observer is not None and ro is not None:
            with timer("dump"):
                metrics.update(ctx.observer.observe(
                    ro, per_sample, correct_reward=cfg.algo.correct_reward, grpo_step=state.grpo_step + 1,
                    global_step=state.global_step + 1, stage=stage.name, stage_step=state.step + 1,
                    max_response_len=stage.max_response_len))
        state.step += 1
        state.global_step += 1
        state.grpo_step += 1
        metrics["grpo_step"] = state.grpo_step
        metrics.update(ctx.entropy_ctl.update(metrics["actor/entropy"]) if "actor/entropy" in metrics else {})
        metrics["actor/entropy_coef"] = ctx.entropy_ctl.alpha
        metrics.update(timer.metrics())
        state.grpo_seconds += metrics["timing/step"]
        if cfg.eval.every and state.step % cfg.eval.every == 0 and state.step < stage.max_steps:
            metrics.update(evaluate(ctx, stage.max_response_len))
        if ctx.is_driver:
            ctx.tracker.log(metrics, step=state.global_step, stage=stage.name)
            bar.advance(state.step, metrics, note)
        if watch.exhausted:  # every rank saw the same batches (None), so every rank stops here
            raise NoUpdateStop(watch.diagnosis() if ctx.is_driver else
                               f"{watch.streak} consecutive steps without an update (see rank 0)")
        stop = plateaued(state, stage, ctx.broadcast(metrics.get("eval/accuracy")))
        if cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0:
            save_checkpoint(ctx, stage, state, loader, rollouts)
        if stop:
            log.info("stage %s: validation accuracy plateaued at step %d", stage.name, state.step)
            break
    return False


def needs_old_logprobs(a: AlgoConfig, batch: SequenceBatch, version: int) -> bool:
    """Whether the old policy's log-probs must be recomputed before the update. With one optimizer
    step on the batch (one pass, one mini-batch) the weights the training forward runs with ARE the
    old policy, whether the tokens were sampled by them or by older ones (rollout.async): the loss
    takes that forward's log-probs, detached, as the old ones (TIS / IcePop weigh them against the
    engine's), and the train-inference gaps are measured on it (:func:`update_policy`), so a
    recompute would only repeat that forward. Recomputed: several optimizer steps (every step after
    the first needs the log-probs from before the first), or a phase that reads them before the
    update: KL in the reward, or a token mask (the old policy's entropy over the whole batch, before
    the first step). Losses that weigh tokens by the engine's log-probs (decoupled PPO's proximal
    policy, TIS / IcePop) read the same detached forward. ``batch`` and ``version`` (the trainer's
    weight version) are what later conditions may read."""
    return (a.n_sgd > 1 or a.mini_batches > 1 or (a.kl.enabled and a.kl.as_reward)
            or a.token_mask.mode != "none")


def add_logprobs(policy: MegatronPolicy, reference: ReferencePolicy | None, batch: SequenceBatch,
                 a: AlgoConfig, temperature: float, version: int, *,
                 teacher: ReferencePolicy | None = None) -> dict:
    """The log-prob phase (step 4): the old policy's, the reference's and the teacher's log-probs of
    every response token, recomputed by the trainer at the sampling temperature (``old_logp`` when
    :func:`needs_old_logprobs`, ``ref_logp`` when ``algo.kl.enabled``, ``teacher_logp`` with
    ``algo.distill``), then, with ``algo.kl.as_reward``, the advantages recomputed from the
    KL-shaped rewards, and with ``algo.token_mask`` the trained tokens (``token_mask``) chosen from
    the old policy's entropy. ``version`` is the trainer's weight version (tokens sampled by older
    ones are stale). Collective."""
    metrics: dict = {}
    routing = StepRouting(a)  # MoE routing replay: the routes each pass replays (or records)
    routes = None
    if needs_old_logprobs(a, batch, version):
        routes = routing.old_pass(batch)
        masked = a.token_mask.mode != "none"
        logp, entropy = policy.compute_logprobs(batch, temperature, with_entropy=masked, routes=routes)
        batch.token_fields["old_logp"] = logp
        trained = [batch.trained(i) for i in range(len(batch))]  # tool observations: no log-probs, not masks
        if masked:  # chosen among the trained tokens (a tool's observation is never a candidate)
            chosen, m = token_masks([e[t] for e, t in zip(entropy, trained)], a.token_mask)
            batch.token_fields["token_mask"] = [torch.zeros_like(t).masked_scatter(t, c)
                                                for t, c in zip(trained, chosen)]
            metrics.update(m)
        gap = [(lp - rl)[t].abs().mean().item()
               for lp, rl, t in zip(logp, batch.token_fields["rollout_logp"], trained) if t.any()]
        metrics["rollout/train_infer_logp_gap"] = sum(gap) / max(1, len(gap))
        versions = batch.token_fields.get("weight_version")
        if versions is not None and any(bool((v != version).any()) for v in versions):
            metrics.update(logp_gap_by_staleness(logp, batch.token_fields["rollout_logp"], versions,
                                                 version, trained))
        metrics.update(routing.after_old_pass(batch, routes, logp))
    metrics.update(routing.diagnose(policy, batch, temperature, measured="moe/router_agreement" in metrics))
    if a.kl.enabled:
        if reference is None:
            raise RuntimeError("algo.kl.enabled needs the reference policy "
                               "(checkpointing.ensure_reference builds it)")
        batch.token_fields["ref_logp"], _ = reference.compute_logprobs(batch, temperature)
        if a.kl.as_reward:
            metrics.update(phases.kl_shaped_advantages(batch, a))
    if a.distill.enabled:
        if teacher is None:
            raise RuntimeError("algo.distill needs the teacher (trainer.teacher.ensure_teacher builds it)")
        batch.token_fields["teacher_logp"], _ = teacher.compute_logprobs(batch, temperature)
    return metrics


def logp_gap_by_staleness(logp: list, rollout_logp: list, versions: list, version: int,
                          trained: list | None = None) -> dict:
    """Mean |trainer - engine| log-prob over the tokens sampled ``d`` versions ago, for each ``d``
    (``trained``: per sequence, the tokens the model sampled; None: all)."""
    keep = torch.cat(trained) if trained is not None else None
    diff = torch.cat([(lp - rl).abs() for lp, rl in zip(logp, rollout_logp)])
    stale = torch.cat([version - v for v in versions])
    if keep is not None:
        diff, stale = diff[keep], stale[keep]
    return {f"async/logp_gap_staleness_{d}": diff[stale == d].mean().item() for d in stale.unique().tolist()}


def update_policy(policy: MegatronPolicy, batch: SequenceBatch, a: AlgoConfig, temperature: float, *,
                  alpha: float, max_response_len: int, seed: int, version: int | None = None
                  ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``n_sgd`` passes over the batch, ``mini_batches`` optimizer steps per pass, each pass in a
    fresh shuffled order (``phases.optimizer_steps`` with the step's ``seed``); metrics averaged over
    the steps (``_min`` / ``_max`` keys: the extremes). ``actor/first_step_ratio_{min,max}`` are the
    first optimizer step's: 1 (to rounding) whenever the old log-probs were recomputed, since
    nothing has changed the policy yet. Also returns per-sample values of the first pass's forwards
    (:data:`phases.SAMPLE_STATS`, ``[B]`` each, batch order) for the dumps.

    Without recomputed old log-probs (:func:`needs_old_logprobs`: one optimizer step) the
    train-inference gaps come from the training forward, before its step: ``rollout/train_infer_logp_gap``
    (the mean over sequences of each one's mean |trainer - engine| log-prob) and, for tokens sampled
    ``d`` versions before ``version`` (the trainer's), ``async/logp_gap_staleness_{d}`` (their mean)."""
    with_entropy = True  # entropy is always measured (metrics, entropy control); its grad only if used
    routing = StepRouting(a)
    schedule = phases.optimizer_steps(batch, a, seed)
    first_pass = len(schedule) // a.n_sgd
    names = phases.SAMPLE_STATS
    gaps = "old_logp" not in batch.token_fields and "rollout_logp" in batch.token_fields
    stale = _staleness(batch, version) if gaps and version is not None else None
    if stale is not None:
        names = names + tuple(f"{k}_{d}" for d in range(stale) for k in ("gap_sum", "gap_n"))
    per_sample = {k: torch.full((len(batch),), float("nan")) for k in names}
    steps = []
    for k, (index, mb) in enumerate(schedule):
        loss_fn = phases.make_loss_fn(mb, a, alpha=alpha, max_response_len=max_response_len)
        fn = phases.sample_stats if stale is None else partial(_stats_with_staleness, version=version, depth=stale)
        ps = PerSequence(fn, names, len(mb)) if k < first_pass else None
        steps.append(policy.train_step(mb, loss_fn, temperature=temperature, with_entropy=with_entropy,
                                       per_sequence=ps, routes=routing.update_pass(mb)))
        if ps is not None:
            for name in names:
                per_sample[name][index] = ps.values[name]
    metrics = reduce_metrics(steps, mean=True)
    if "actor/ratio_min" in steps[0]:
        metrics["actor/first_step_ratio_min"] = steps[0]["actor/ratio_min"]
        metrics["actor/first_step_ratio_max"] = steps[0]["actor/ratio_max"]
    if gaps:
        metrics["rollout/train_infer_logp_gap"] = float(per_sample["logp_gap_mean"].nanmean())
    if stale is not None:
        for d in range(stale):
            n = float(per_sample.pop(f"gap_n_{d}").nansum())
            total = float(per_sample.pop(f"gap_sum_{d}").nansum())
            if n:
                metrics[f"async/logp_gap_staleness_{d}"] = total / n
    return metrics, per_sample


def _staleness(batch: SequenceBatch, version: int) -> int | None:
    """1 + the largest staleness of any token when some token is stale, else None."""
    versions = batch.token_fields.get("weight_version")
    if versions is None:
        return None
    most = max((int((version - v).max()) for v in versions if v.numel()), default=0)
    return most + 1 if most > 0 else None


def _stats_with_staleness(mb, *, version: int, depth: int) -> dict[str, torch.Tensor]:
    """:func:`phases.sample_stats` and, per staleness ``d < depth``, the sequence's summed
    |trainer - engine| log-prob over its tokens sampled ``d`` versions ago, and their count."""
    out = phases.sample_stats(mb)
    gap = (mb.logp.detach() - mb.fields["rollout_logp"]).abs()
    stale = version - mb.fields["weight_version"]
    for d in range(depth):
        at = mb.mask & (stale == d)
        out[f"gap_sum_{d}"] = gap.masked_fill(~at, 0.0).sum(1)
        out[f"gap_n_{d}"] = at.sum(1).float()
    return out


def plateaued(state: TrainerState, stage: StageConfig, accuracy: float | None) -> bool:
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
