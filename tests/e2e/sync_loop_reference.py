"""Today's synchronous GRPO step walk, as it was before ``rollout.async`` (commit acf3eec): the
reference that ``rollout.async.max_staleness=0`` must reproduce exactly. ``python
tests/e2e/sync_loop_reference.py train ...`` is ``megatron-rl train ...`` with this loop.

Each step: next prompts -> generate (seed of the step) -> score -> make_batch -> old log-probs
(skipped strictly on-policy) -> update -> sync -> observe (rollout dumps and the wrong-label monitor,
added after acf3eec; the async scheduler does not touch it), in turn; nothing overlaps.
"""

from __future__ import annotations

import sys

from megatron_rl.trainer import grpo, phases
from megatron_rl.trainer.checkpointing import save_checkpoint
from megatron_rl.trainer.evaluate import evaluate, sync_weights


def add_old_logprobs(policy, batch, a, temperature) -> dict:
    if a.n_sgd == 1 and a.mini_batches == 1 and a.mismatch.mode == "none":
        return {}
    logp, _ = policy.compute_logprobs(batch, temperature, with_entropy=False)
    batch.token_fields["old_logp"] = logp
    gap = [(lp - rl).abs().mean().item() for lp, rl in zip(logp, batch.token_fields["rollout_logp"])]
    return {"rollout/train_infer_logp_gap": sum(gap) / max(1, len(gap))}


def run_steps(ctx, stage, state, loader, rollouts, bar) -> None:
    cfg = ctx.cfg
    while state.step < stage.max_steps and not ctx.stop_agreed():
        timer = grpo.StepTimer()
        metrics: dict = {}
        batch = None
        if ctx.is_driver:
            records = loader.next_batch()
            with timer("gen"):
                ro = phases.generate(ctx.engine, records, cfg.rollout, stage.max_response_len,
                                     seed=phases.sampling_seed(cfg.trainer.seed, state.global_step))
            with timer("reward"):
                metrics.update(phases.score(ctx.reward_mgr, ro))
            metrics.update(phases.rollout_metrics(ro, cfg.algo.correct_reward))
            batch, m = phases.make_batch(ro, cfg.algo)
            metrics.update(m)
        batch = ctx.broadcast(batch)
        per_sample = None
        if batch is not None:
            with timer("logprob"):
                metrics.update(add_old_logprobs(ctx.policy, batch, cfg.algo, cfg.rollout.temperature))
            with timer("update"):
                m, per_sample = grpo.update_policy(ctx.policy, batch, cfg.algo, cfg.rollout.temperature,
                                                   alpha=ctx.entropy_ctl.alpha,
                                                   max_response_len=stage.max_response_len,
                                                   seed=phases.sampling_seed(cfg.trainer.seed,
                                                                             state.global_step))
                metrics.update(m)
            with timer("sync"):
                state.weight_version += 1
                metrics.update(sync_weights(ctx, state.weight_version))
        if ctx.is_driver and ctx.observer is not None:
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
            bar.advance(state.step, metrics)
        if cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0:
            save_checkpoint(ctx, stage, state, loader)


if __name__ == "__main__":
    grpo.run_steps = run_steps
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
