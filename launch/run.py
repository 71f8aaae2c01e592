"""Launch stages of the Skywork-OR1 recipe with NeMo-Run.

    python -m launch.run --stage stage1 --executor slurm --dry-run          # print the sbatch script
    python -m launch.run --stage stage2 --executor slurm --nodes 4 --account A --partition P \\
        --container-image IMAGE                                             # submit (sbatch)
    python -m launch.run --stage 1,2,3 --executor slurm --nodes 4 --account A   # three jobs, chained
    python -m launch.run --stage stage1 --executor local \\
        --config configs/demo_cpu.yaml --run-dir runs/demo                  # run here, wait

The stages share one run directory: stage N starts from stage N-1's final checkpoint found there
and resumes from its own newest checkpoint after a requeue (see slurm/common.sh for the same
behaviour with plain sbatch). Several stages in one call are one NeMo-Run experiment: each stage's
job depends on the previous one (Slurm ``--dependency=afterok``; the local executor runs them one
after the other). NEMORUN_HOME is ``--job-dir``, else $NEMORUN_HOME, else <run dir>/nemorun; each
job's sbatch script and logs are in $NEMORUN_HOME/experiments/<experiment>/<experiment id>/<stage>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from launch.config import HOME, LaunchConfig
from megatron_rl.common.cli_args import ArgumentParser, run_main
from launch.executors import check_run_config, make_executors, make_tasks, node_command, resolve_stage


def _experiment_title(cfg: LaunchConfig, stages: list[str]) -> str:
    return f"mrl-{cfg.size}-{'-'.join(stages)}"


def _nemorun_home(cfg: LaunchConfig, run_dir: Path) -> Path:
    if cfg.job_dir:
        return Path(cfg.job_dir).absolute()
    return Path(os.environ.get("NEMORUN_HOME") or run_dir / "nemorun").absolute()


def _home_source(cfg: LaunchConfig) -> str:
    """Where NEMORUN_HOME comes from (the key a refusal names)."""
    if cfg.job_dir:
        return "job_dir"
    return "NEMORUN_HOME" if os.environ.get("NEMORUN_HOME") else "run_dir"


def _make_dir(cfg: LaunchConfig, key: str, path: Path, create: bool = True) -> None:
    """Create ``path`` (and its parents) or refuse naming ``key``; ``create=False`` (a dry run): only
    check that it could be (its nearest existing parent is a directory this user can write)."""
    if not create:
        here = path
        while not here.exists() and here != here.parent:
            here = here.parent
        if path.is_dir() or (here.is_dir() and os.access(here, os.W_OK | os.X_OK)):
            return
        why = "Not a directory" if not here.is_dir() else "Permission denied"
        cfg.fail(key, f"cannot create the directory {path}: {why} ({here})")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        cfg.fail(key, f"cannot create the directory {path}: {exc.strerror or exc}")


def _prepare(cfgs: list[LaunchConfig], make_home: bool = True, make_run_dirs: bool = True):
    """Validated configs (one per stage) -> (stage names, [(tasks, executors)]), NEMORUN_HOME set: per
    stage one task, or with dedicated engines a trainer group and an engine group (one
    heterogeneous job). The job directory and the run directories are created (``make_home`` /
    ``make_run_dirs``; else only checked that they could be) or refused naming the key, before
    anything is written or submitted."""
    stages, jobs, homes = [], [], set()
    for cfg in cfgs:
        cfg.validate()
        stage, run_dir = resolve_stage(cfg)
        check_run_config(cfg, stage, run_dir)
        home = _nemorun_home(cfg, run_dir)
        cfg.check_script_paths({"run_dir": str(run_dir), "job_dir": str(home), "config": str(cfg.config_path()),
                                "venv": cfg.venv, "overrides": " ".join(cfg.overrides),
                                "env": " ".join(cfg.env.values())})
        if "/nemo_run" in str(HOME) and cfg.executor == "slurm" and not cfg.container_image:
            cfg.fail("config", f"the checkout {HOME} has '/nemo_run' in its path, which NeMo-Run's Slurm "
                               "script generator replaces (without a container); move the checkout")
        stages.append(stage)
        homes.add(home)
        jobs.append((cfg, stage, run_dir))
    if len(homes) != 1:
        cfgs[0].fail("job_dir", f"the stages of one launch need one NEMORUN_HOME, got {sorted(map(str, homes))}")
    home = homes.pop()
    _make_dir(cfgs[0], _home_source(cfgs[0]), home, create=make_home)
    for cfg, _, run_dir in jobs:
        _make_dir(cfg, "run_dir", run_dir, create=make_run_dirs)
    os.environ["NEMORUN_HOME"] = str(home)
    import nemo_run.config

    nemo_run.config.set_nemorun_home(str(home))  # read once when nemo_run is imported
    return stages, [(make_tasks(cfg, stage, run_dir), make_executors(cfg, run_dir)) for cfg, stage, run_dir in jobs]


def _add(exp, tasks: list, executors: list, stage: str) -> None:
    if len(tasks) == 1:
        exp.add(tasks[0], executor=executors[0], name=stage)
    else:
        exp.add(tasks, executor=executors, name=stage)


def _dryrun_info(job):
    """The dry run's request NeMo-Run keeps on the job (a job group: on its first member)."""
    return job._dryrun_infos[0] if hasattr(job, "_dryrun_infos") else job._dryrun_info


def dry_run(cfgs: list[LaunchConfig]) -> str:
    """The sbatch scripts NeMo-Run would submit (Slurm), or the commands it would run (local)."""
    # (NeMo-Run's Slurm dry run writes the experiment under NEMORUN_HOME; the local one writes nothing)
    stages, jobs = _prepare(cfgs, make_home=cfgs[0].executor == "slurm", make_run_dirs=False)
    if cfgs[0].executor == "local":
        return "\n".join(" ".join(["bash", tasks[0].path, *tasks[0].args]) for tasks, _ in jobs)
    import nemo_run as run

    with run.Experiment(_experiment_title(cfgs[0], stages), executor=jobs[0][1][0], log_level="WARN") as exp:
        for stage, (tasks, executors) in zip(stages, jobs):
            _add(exp, tasks, executors, stage)
        exp.dryrun(log=False)
        # materialize() renders the sbatch text.
        return "\n".join(_dryrun_info(job).request.materialize() for job in exp.jobs)


def launch(cfgs: list[LaunchConfig]) -> int:
    """Submit (Slurm: returns once sbatch accepted the jobs) or run and wait (local)."""
    stages, jobs = _prepare(cfgs)
    import nemo_run as run

    detach = cfgs[0].executor == "slurm"
    with run.Experiment(_experiment_title(cfgs[0], stages), executor=jobs[0][1][0], log_level="WARN") as exp:
        for stage, (tasks, executors) in zip(stages, jobs):
            _add(exp, tasks, executors, stage)
        exp.run(sequential=True, detach=detach, tail_logs=False)
    status = exp.status(return_dict=True) or {}
    ok = True
    for job in exp.jobs:
        info = status.get(job.id) or {}
        if detach:  # sbatch accepted it; its state is Slurm's to report (squeue)
            what = f"submitted as Slurm job {info.get('job_id', '?')}"
        else:
            what = str(info.get("status", "UNKNOWN"))
            ok = ok and what.startswith("SUCCEEDED")
        print(f"launch: {job.id}: {what}; logs in {job.executor.job_dir}", file=sys.stderr)
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> tuple[list[LaunchConfig], bool]:
    p = ArgumentParser(prog="python -m launch.run", command="launch", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True,
                   help="stage1 | stage2 | stage3 (or 1 | 2 | 3); several, comma-separated, are chained")
    p.add_argument("--executor", default="slurm", choices=["slurm", "local"])
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script (or command) only")
    p.add_argument("--size", default="7b")
    p.add_argument("--config", default="")
    p.add_argument("--stage-name", default="")
    p.add_argument("--run-dir", default="")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--cpus-per-task", type=int, default=0)
    p.add_argument("--master-port", type=int, default=0,
                   help="torchrun rendezvous port (Slurm; default 20000 + job id mod 20000)")
    p.add_argument("--nproc-per-node", type=int, default=0)
    p.add_argument("--account", default="")
    p.add_argument("--partition", default="")
    p.add_argument("--time", default="48:00:00")
    p.add_argument("--container-image", default="")
    p.add_argument("--container-mount", action="append", default=[], help="src:dst (repeatable)")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE (repeatable)")
    p.add_argument("--venv", default="")
    p.add_argument("--max-requeues", type=int, default=50)
    p.add_argument("--job-dir", default="", help="NEMORUN_HOME (default: $NEMORUN_HOME, else <run dir>/nemorun)")
    p.add_argument("--rollout-placement", default="colocated", choices=["colocated", "dedicated"],
                   help="dedicated: --rollout-nodes more nodes run only the vLLM engines (Slurm)")
    p.add_argument("--rollout-nodes", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides for the trainer")
    a = p.parse_args(argv)
    stages = [s.strip().removeprefix("stage") for s in a.stage.split(",")]
    if not all(s.isdigit() for s in stages):
        p.error(f"--stage must be stage1, stage2 or stage3 (comma-separated for several), got {a.stage!r}")
    if len(stages) > 1 and [int(s) for s in stages] != sorted({int(s) for s in stages}):
        p.error(f"--stage: chained stages run in order, each once (each starts from the one before), got {a.stage!r}")
    if len(stages) > 1 and a.stage_name:
        p.error("--stage-name names one stage; give one --stage with it")
    env = {}
    for item in a.env:
        if "=" not in item:
            p.error(f"--env must be NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        env[k] = v
    cfg = LaunchConfig(
        stage=int(stages[0]), size=a.size, config=a.config, stage_name=a.stage_name, run_dir=a.run_dir,
        overrides=list(a.overrides), executor=a.executor, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
        cpus_per_task=a.cpus_per_task, nproc_per_node=a.nproc_per_node, account=a.account,
        partition=a.partition, time=a.time, container_image=a.container_image,
        container_mounts=list(a.container_mount), env=env, venv=a.venv, max_requeues=a.max_requeues,
        master_port=a.master_port, job_dir=a.job_dir, rollout_placement=a.rollout_placement,
        rollout_nodes=a.rollout_nodes)
    return [dataclasses.replace(cfg, stage=int(s)) for s in stages], a.dry_run


def main(argv: list[str] | None = None) -> int:
    """Submit or run the stages; a bad command line, config or input is one line on stderr,
    ``megatron-rl: ...``, exit 2 (as every entry point: ``megatron_rl.common.cli_args``)."""

    def go() -> int:
        cfgs, dry = parse_args(argv)
        if dry:
            print(dry_run(cfgs))
            return 0
        return launch(cfgs)

    return run_main(go)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["dry_run", "launch", "main", "node_command", "parse_args"]
