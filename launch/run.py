"""Launch one stage of the Skywork-OR1 recipe with NeMo-Run.

    python -m launch.run --stage stage1 --executor slurm --dry-run          # print the sbatch script
    python -m launch.run --stage stage2 --executor slurm --nodes 4 --account A --partition P \\
        --container-image IMAGE                                             # submit (sbatch)
    python -m launch.run --stage stage1 --executor local \\
        --config configs/demo_cpu.yaml --run-dir runs/demo                  # run here, wait

The stages share one run directory: stage N starts from stage N-1's final checkpoint found there
and resumes from its own newest checkpoint after a requeue (see slurm/common.sh for the same
behaviour with plain sbatch). NEMORUN_HOME defaults to <run dir>/nemo_run/home.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from launch.config import LaunchConfig
from launch.executors import make_executors, make_tasks, node_command, resolve_stage


def _experiment_title(cfg: LaunchConfig, stage: str) -> str:
    return f"mrl-{cfg.size}-{stage}"


def _prepare(cfg: LaunchConfig):
    """Validated config -> (stage name, run dir, job dir, tasks, executors): one task, or with
    dedicated engines a trainer group and an engine group (one heterogeneous job)."""
    cfg.validate()
    stage, run_dir = resolve_stage(cfg)
    job_dir = Path(cfg.job_dir) if cfg.job_dir else run_dir / "nemo_run"
    os.environ.setdefault("NEMORUN_HOME", str(job_dir / "home"))
    return stage, run_dir, job_dir, make_tasks(cfg, stage, run_dir), make_executors(cfg, run_dir, job_dir)


def _add(exp, tasks: list, executors: list, stage: str) -> None:
    if len(tasks) == 1:
        exp.add(tasks[0], executor=executors[0], name=stage)
    else:
        exp.add(tasks, executor=executors, name=stage)


def dry_run(cfg: LaunchConfig) -> str:
    """The sbatch script NeMo-Run would submit (Slurm), or the command it would run (local)."""
    stage, run_dir, _job_dir, tasks, executors = _prepare(cfg)
    if cfg.executor == "local":
        return " ".join(["bash", tasks[0].path, *tasks[0].args])
    import nemo_run as run

    with run.Experiment(_experiment_title(cfg, stage), executor=executors[0], log_level="WARN") as exp:
        _add(exp, tasks, executors, stage)
        exp.dryrun(log=False)
        # NeMo-Run keeps the dry run's request on the job (a job group: on its first member);
        # materialize() renders the sbatch text.
        job = exp.jobs[0]
        info = job._dryrun_infos[0] if hasattr(job, "_dryrun_infos") else job._dryrun_info
        return info.request.materialize()


def launch(cfg: LaunchConfig) -> int:
    """Submit (Slurm: returns once sbatch accepted the job) or run and wait (local)."""
    stage, run_dir, _job_dir, tasks, executors = _prepare(cfg)
    import nemo_run as run

    run_dir.mkdir(parents=True, exist_ok=True)
    detach = cfg.executor == "slurm"
    with run.Experiment(_experiment_title(cfg, stage), executor=executors[0], log_level="WARN") as exp:
        _add(exp, tasks, executors, stage)
        exp.run(sequential=True, detach=detach, tail_logs=False)
    status = exp.status(return_dict=True) or {}
    state = str((status.get(stage) or {}).get("status", "UNKNOWN"))
    print(f"launch: {stage} via {cfg.executor}: {state}", file=sys.stderr)
    if detach:
        return 0
    return 0 if state.startswith("SUCCEEDED") else 1


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, bool]:
    p = argparse.ArgumentParser(prog="python -m launch.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, help="stage1 | stage2 | stage3 (or 1 | 2 | 3)")
    p.add_argument("--executor", default="slurm", choices=["slurm", "local"])
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script (or command) only")
    p.add_argument("--size", default="7b")
    p.add_argument("--config", default="")
    p.add_argument("--stage-name", default="")
    p.add_argument("--run-dir", default="")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nproc-per-node", type=int, default=0)
    p.add_argument("--account", default="")
    p.add_argument("--partition", default="")
    p.add_argument("--time", default="48:00:00")
    p.add_argument("--container-image", default="")
    p.add_argument("--container-mount", action="append", default=[], help="src:dst (repeatable)")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE (repeatable)")
    p.add_argument("--venv", default="")
    p.add_argument("--max-requeues", type=int, default=50)
    p.add_argument("--job-dir", default="")
    p.add_argument("--rollout-placement", default="colocated", choices=["colocated", "dedicated"],
                   help="dedicated: --rollout-nodes more nodes run only the vLLM engines (Slurm)")
    p.add_argument("--rollout-nodes", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides for the trainer")
    a = p.parse_args(argv)
    stage = a.stage.removeprefix("stage")
    if not stage.isdigit():
        p.error(f"--stage must be stage1, stage2 or stage3, got {a.stage!r}")
    env = {}
    for item in a.env:
        if "=" not in item:
            p.error(f"--env must be NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        env[k] = v
    cfg = LaunchConfig(
        stage=int(stage), size=a.size, config=a.config, stage_name=a.stage_name, run_dir=a.run_dir,
        overrides=list(a.overrides), executor=a.executor, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
        nproc_per_node=a.nproc_per_node, account=a.account, partition=a.partition, time=a.time,
        container_image=a.container_image, container_mounts=list(a.container_mount), env=env,
        venv=a.venv, max_requeues=a.max_requeues, job_dir=a.job_dir,
        rollout_placement=a.rollout_placement, rollout_nodes=a.rollout_nodes)
    return cfg, a.dry_run


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.config import ConfigError

    cfg, dry = parse_args(argv)
    try:
        if dry:
            print(dry_run(cfg))
            return 0
        return launch(cfg)
    except ConfigError as exc:
        print(f"launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["dry_run", "launch", "main", "node_command", "parse_args"]
