"""A whole run: optional SFT cold start, then the GRPO stages, evaluations, summary and report."""

from __future__ import annotations

import json
import logging

from megatron_rl.tracking.progress import Phase
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.evaluate import record_eval
from megatron_rl.trainer.grpo import train_stage
from megatron_rl.trainer.sft import run_sft, run_sft_control
from megatron_rl.trainer.state import RunDir
from megatron_rl.trainer.stop import REQUEUE_EXIT_CODE

log = logging.getLogger("megatron_rl")


def nothing_left(cfg, only_stage: str | None = None) -> bool:
    """Whether the run directory already holds everything :func:`run` would make: every stage it
    would run finished, the control experiment (when configured) done, the summary written. The
    entry point then returns before building anything (a finished run started again, a requeued
    job of a finished stage), reading only ``run_state.json``, on every rank alike."""
    run_dir = RunDir(cfg.trainer.run_dir)
    rs = run_dir.read_run_state()
    stages = [only_stage] if only_stage else [s.name for s in cfg.stages]
    if not set(stages) <= set(rs["finished_stages"]):
        return False
    if cfg.sft.enabled and cfg.sft.control and not only_stage and "control" not in rs:
        return False
    return (run_dir.root / "summary.json").exists()


def run(ctx: Context, only_stage: str | None = None) -> int:
    """Run the configured stages (or just ``only_stage``), then close the context's parts.
    Returns the process exit code."""
    cfg = ctx.cfg
    try:
        stages = [cfg.stage(only_stage)] if only_stage else list(cfg.stages)
        first = stages[0].name == cfg.stages[0].name
        if first and cfg.sft.enabled:
            run_sft(ctx)
            if ctx.stop_agreed():
                return REQUEUE_EXIT_CODE
        # The start evaluation scores the weights the first stage starts from (trainer.init_from, the
        # cold start's, or the base model's), once the stage has loaded them into the engines.
        eval_start = first and not ctx.run.read_run_state().get("eval", {}).get("start")
        for stage in stages:
            if ctx.is_driver and stage.name in ctx.run.read_run_state()["finished_stages"]:
                log.info("stage %s already finished; skipping", stage.name)
                continue
            train_stage(ctx, stage, eval_start=eval_start and stage.name == cfg.stages[0].name)
            if ctx.stop_agreed():
                log.warning("stopped on a signal; exit %d asks the scheduler to requeue", REQUEUE_EXIT_CODE)
                return REQUEUE_EXIT_CODE
            record_eval(ctx, stage.name, stage.max_response_len)
        if cfg.sft.enabled and cfg.sft.control and not only_stage:
            control(ctx)
        if ctx.is_driver:
            write_summary(ctx)
        return 0
    finally:
        close(ctx)


def control(ctx: Context) -> None:
    """SFT for as long as GRPO took, from the cold start (see run_sft_control); once per run."""
    rs = ctx.run.read_run_state() if ctx.is_driver else {}
    if ctx.broadcast("control" in rs):
        return
    last = ctx.run.final_dir(ctx.cfg.stages[-1].name)
    st = ctx.broadcast(RunDir.read_state(last) if ctx.is_driver else None)
    m = run_sft_control(ctx, st.grpo_seconds, step_offset=st.global_step)
    if ctx.is_driver and m:
        ctx.run.write_run_state({**ctx.run.read_run_state(), "control": m})
        log.info("control: %d more SFT steps in %.0f s -> held-out accuracy %.3f",
                 m["control/sft_steps"], m["control/seconds"], m["control/accuracy"])


def write_summary(ctx: Context) -> dict:
    from megatron_rl.analysis import analyze

    rs = ctx.run.read_run_state()
    ev = rs.get("eval", {})
    stages = [s.name for s in ctx.cfg.stages if s.name in ev]
    start = ev.get("start", {}).get("eval/accuracy")
    end = ev[stages[-1]]["eval/accuracy"] if stages else None
    summary = {
        "accuracy_after_sft": start,
        "accuracy_after_grpo": end,
        "gain_points": None if start is None or end is None else 100.0 * (end - start),
        "eval_problems": ev.get("start", {}).get("eval/n"),
        "per_stage": {k: v for k, v in ev.items()},
        "finished_stages": rs["finished_stages"],
        "sft_steps": rs.get("sft_steps"),
        "sft_seconds": rs.get("sft_seconds"),
    }
    if "control" in rs:
        c = rs["control"]
        summary["control"] = {
            "what": "SFT from the cold start for the same wall time as the GRPO stages",
            "accuracy_after_more_sft": c["control/accuracy"], "sft_steps": c["control/sft_steps"],
            "seconds": c["control/seconds"],
            "gain_points": None if start is None else 100.0 * (c["control/accuracy"] - start),
            "grpo_minus_control_points": None if end is None else 100.0 * (end - c["control/accuracy"]),
        }
    (ctx.run.root / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        with Phase("run report", enabled=ctx.cfg.tracking.console):
            facts = analyze(ctx.run.root)
        log.info("run report: %s", facts["report"])
    except Exception:  # the run's results stand; `megatron-rl analyze RUN_DIR` can retry
        log.exception("writing the run report failed")
        facts = {}
    if facts.get("expert_load"):  # a MoE run: the last step's expert load joins the summary
        load = summary["expert_load"] = facts["expert_load"]
        (ctx.run.root / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info("expert load, last step: most loaded expert %s of its layer's assignments (layer %s), "
                 "least loaded %s; load-balancing loss %s -> %s", load["most_loaded"], load["most_loaded_layer"],
                 load["least_loaded"], load["aux_loss_first"], load["aux_loss_last"])
    ctx.tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    return summary


def close(ctx: Context) -> None:
    for obj in (ctx.weight_sync, ctx.reward_mgr, ctx.envs, ctx.tracker, ctx.engine, ctx.launcher):
        if obj is not None:
            try:
                obj.close()
            except Exception as exc:  # closing must never mask the run's own error
                log.warning("close %s: %s", type(obj).__name__, exc)
