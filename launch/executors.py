"""NeMo-Run executors and the task for one stage of the recipe.

Both executors run ``slurm/node_launch.sh`` on every node, the same per-node wrapper the sbatch
scripts use: it starts the trainer (torchrun, or one process), forwards USR1 to the trainer
processes and reports "checkpointed, requeue me" as exit code 99.

- Slurm: NeMo-Run writes and submits the sbatch script (through a LocalTunnel: run this where
  ``sbatch`` works). One task per node runs torchrun with a c10d rendezvous on the first node
  (``$head_node_ip``, which NeMo-Run's script resolves). No ``--signal``: NeMo-Run's script runs
  srun in the foreground, where a batch-shell trap cannot fire, and a step-wide signal would kill
  the trainer's helper processes; instead node_launch.sh watches the time left (squeue) and asks
  the trainer to checkpoint ``signal_lead`` seconds before the limit. NeMo-Run's script requeues
  the job when the step exits non-zero, up to ``max_requeues`` times. Optional pyxis container: the
  checkout and the run directory are mounted at the same paths.
- Local: the same command on this machine (the CPU miniature: one process, no torchrun).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from launch.config import HOME, LaunchConfig

NODE_LAUNCH = HOME / "slurm" / "node_launch.sh"


def resolve_stage(cfg: LaunchConfig) -> tuple[str, Path]:
    """The stage name to run and the absolute run directory (from the config unless given)."""
    from megatron_rl.config.loader import load_yaml_tree

    tree = load_yaml_tree(cfg.config_path())
    stages = tree.get("stages") or []
    name = cfg.stage_name
    if not name:
        if len(stages) < cfg.stage:
            cfg.fail("stage", f"{cfg.config_path()} has {len(stages)} stages, no stage {cfg.stage}")
        name = stages[cfg.stage - 1]["name"]
    run_dir = Path(cfg.run_dir or (tree.get("trainer") or {}).get("run_dir", "runs/default"))
    return name, run_dir if run_dir.is_absolute() else HOME / run_dir


def trainer_args(cfg: LaunchConfig, stage: str, run_dir: Path) -> list[str]:
    """Arguments of ``megatron-rl`` for the stage."""
    return ["train", "--config", str(cfg.config_path()), "--run-dir", str(run_dir), "--stage", stage,
            *cfg.overrides]


def node_command(cfg: LaunchConfig, stage: str, run_dir: Path) -> list[str]:
    """What node_launch.sh runs on each node."""
    args = trainer_args(cfg, stage, run_dir)
    nproc = cfg.procs_per_node()
    if cfg.executor == "slurm":
        # Quoted here: NeMo-Run pastes the arguments into the srun line as they are, so that the
        # rendezvous variables below expand in the batch shell.
        port = str(cfg.master_port) if cfg.master_port else "$((20000+SLURM_JOB_ID%20000))"
        return ["torchrun", f"--nnodes={cfg.nodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=$head_node_ip:{port}", "--rdzv-id=$SLURM_JOB_ID",
                "--max-restarts=0", "-m", "megatron_rl.cli", *map(shlex.quote, args)]
    if nproc == 1:
        return ["python", "-m", "megatron_rl.cli", *args]
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
            "-m", "megatron_rl.cli", *args]


def task_env(cfg: LaunchConfig) -> dict[str, str]:
    direct = cfg.executor == "local" and cfg.procs_per_node() == 1
    env = {"MEGATRON_RL_HOME": str(HOME), "LAUNCHER": "direct" if direct else "torchrun"}
    if cfg.executor == "slurm":
        env["MRL_STOP_BEFORE_END_S"] = str(cfg.signal_lead())
    if cfg.venv:
        env["VENV"] = cfg.venv
    return {**env, **cfg.env}


def make_task(cfg: LaunchConfig, stage: str, run_dir: Path):
    import nemo_run as run

    command = node_command(cfg, stage, run_dir)
    if cfg.executor == "slurm":
        command = [shlex.quote(str(NODE_LAUNCH)), *command]
    else:
        command = [str(NODE_LAUNCH), *command]
    return run.Script(path=command[0], args=command[1:], entrypoint="bash")


def slurm_executor(cfg: LaunchConfig, run_dir: Path):
    import nemo_run as run

    mounts: list[str] = []
    if cfg.container_image:
        mounts = [f"{HOME}:{HOME}", f"{run_dir.parent}:{run_dir.parent}", *cfg.container_mounts]
    return run.SlurmExecutor(
        account=cfg.account or None,  # no --account line: clusters without accounting
        partition=cfg.partition or None,
        job_name_prefix="mrl-",
        nodes=cfg.nodes,
        ntasks_per_node=1,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task or None,
        exclusive=True,
        time=cfg.time,
        container_image=cfg.container_image or None,
        container_mounts=mounts,
        env_vars=task_env(cfg),
        retries=cfg.max_requeues,
        # The tunnel's job dir must be the experiment's own dir ($NEMORUN_HOME/experiments/...,
        # LocalTunnel's default): sbatch is given the script there and srun runs in its code/.
        tunnel=run.LocalTunnel(job_dir=""),
        packager=run.Packager(),  # the checkout is used in place (mounted when in a container)
    )


def local_executor(cfg: LaunchConfig):
    import nemo_run as run

    # node_launch.sh starts torchrun itself when nproc > 1, so NeMo-Run's own launcher stays off.
    return run.LocalExecutor(ntasks_per_node=1, env_vars=task_env(cfg))


def make_executor(cfg: LaunchConfig, run_dir: Path):
    return slurm_executor(cfg, run_dir) if cfg.executor == "slurm" else local_executor(cfg)
