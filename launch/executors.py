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

Rollout engines (the config's ``rollout.engine`` is ``vllm_server``): colocated, node_launch.sh
starts each node's vLLM servers before the trainer (``MRL_ENGINE_ARGS``); dedicated (Slurm), the job
is heterogeneous: group 0 the trainer nodes, group 1 ``rollout_nodes`` engine nodes that run only
``node_launch.sh --engines``. NeMo-Run's group monitor stops the engine group when the trainer group
exits. The trainer finds the engines in the run directory's registry and sends weights from its
first node through vLLM's RL routes.
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


# Expanded by the batch shell of a heterogeneous (dedicated) job: the first trainer host and the
# engine group's hosts.
TRAINER_HOST = "$het_group_host_0"
ENGINE_HOSTS = "$(scontrol show hostnames $SLURM_JOB_NODELIST_HET_GROUP_1 | paste -sd, -)"
# The first node's address in NeMo-Run's Slurm batch script.
HEAD_NODE_IP = "$head_node_ip"


def uses_servers(cfg: LaunchConfig) -> bool:
    """The run's rollout engines are vLLM servers (the config and its overrides say so)."""
    from megatron_rl.config.loader import apply_override, load_yaml_tree

    tree = load_yaml_tree(cfg.config_path())
    for item in cfg.overrides:
        tree = apply_override(tree, item)
    return (tree.get("rollout") or {}).get("engine", "vllm") == "vllm_server"


def engine_overrides(cfg: LaunchConfig) -> list[str]:
    """Overrides the trainer and the engine launchers share, by placement (unquoted: some name
    batch-shell variables; none contains white space once expanded)."""
    if cfg.rollout_placement == "dedicated":
        return ["rollout.engine=vllm_server", "rollout.placement=dedicated", "rollout.num_engines=0",
                f"rollout.hosts=[{ENGINE_HOSTS}]", f"sync.master_addr={TRAINER_HOST}"]
    if uses_servers(cfg):
        addr = HEAD_NODE_IP if cfg.executor == "slurm" else "127.0.0.1"
        return ["rollout.placement=colocated", f"sync.master_addr={addr}"]
    return []


def check_run_config(cfg: LaunchConfig, stage: str, run_dir: Path) -> None:
    """The trainer's config as the job will load it (its overrides, the placement's, the run
    directory), validated here before anything is printed or submitted: a bad key or value is
    refused now, naming it, not in the job. So is a layout the job cannot run: the trainer's
    TP x PP x CP against its processes (nodes x processes per node), more processes per node than
    GPUs, a vLLM engine (or a node's engines) needing more GPUs than a node has."""
    from megatron_rl.tools.job_config import check_job_config

    nproc = cfg.procs_per_node()
    world_from = (f"--nodes ({cfg.nodes}) x " + (f"--nproc-per-node ({nproc})" if cfg.nproc_per_node else
                                                 f"--gpus-per-node ({nproc})" if cfg.executor == "slurm" else
                                                 "1 process (--nproc-per-node)"))
    run, _ = check_job_config(str(cfg.config_path()), [f"trainer.run_dir={run_dir}", *cfg.overrides], stage=stage,
                              dedicated=cfg.rollout_placement == "dedicated", world_size=cfg.nodes * nproc,
                              world_from=world_from)
    if cfg.executor != "slurm":
        return
    if nproc > cfg.gpus_per_node:
        cfg.fail("nproc_per_node", f"{nproc} trainer processes per node, but --gpus-per-node is {cfg.gpus_per_node}: "
                                   f"one GPU each")
    r = run.rollout
    if r.engine == "vllm_server":
        per_node = r.tensor_parallel_size * r.engines_per_node
        if per_node > cfg.gpus_per_node:
            from megatron_rl.config.base import ConfigError

            raise ConfigError("rollout.engines_per_node", f"{r.engines_per_node} engines x rollout.tensor_parallel_size "
                                                          f"{r.tensor_parallel_size} = {per_node} GPUs per node, but "
                                                          f"--gpus-per-node is {cfg.gpus_per_node}")


def _quote(arg: str) -> str:
    """Quoted for the batch shell, leaving ``$var`` / ``$(...)`` to expand."""
    return f'"{arg}"' if "$" in arg else shlex.quote(arg)


def trainer_args(cfg: LaunchConfig, stage: str, run_dir: Path) -> list[str]:
    """Arguments of ``megatron-rl`` for the stage."""
    return ["train", "--config", str(cfg.config_path()), "--run-dir", str(run_dir), "--stage", stage,
            *engine_overrides(cfg), *cfg.overrides]


def engine_args(cfg: LaunchConfig, run_dir: Path) -> list[str]:
    """Arguments of ``megatron-rl engines`` (a node's vLLM servers) for the same run."""
    return ["engines", "--config", str(cfg.config_path()), "--run-dir", str(run_dir),
            *engine_overrides(cfg), *cfg.overrides]


def node_command(cfg: LaunchConfig, stage: str, run_dir: Path) -> list[str]:
    """What node_launch.sh runs on each node."""
    args = trainer_args(cfg, stage, run_dir)
    nproc = cfg.procs_per_node()
    if cfg.executor == "slurm":
        # Quoted here: NeMo-Run pastes the arguments into the srun line as they are, so that the
        # rendezvous variables below expand in the batch shell.
        port = str(cfg.master_port) if cfg.master_port else "$((20000+SLURM_JOB_ID%20000))"
        head = TRAINER_HOST if cfg.rollout_placement == "dedicated" else HEAD_NODE_IP
        return ["torchrun", f"--nnodes={cfg.nodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={head}:{port}", "--rdzv-id=$SLURM_JOB_ID",
                "--max-restarts=0", "-m", "megatron_rl.cli", *map(_quote, args)]
    if nproc == 1:
        return ["python", "-m", "megatron_rl.cli", *args]
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
            "-m", "megatron_rl.cli", *args]


def task_env(cfg: LaunchConfig, run_dir: Path, *, engines: bool = False) -> dict[str, str]:
    """The environment of the trainer task (or, ``engines``, of the engine group's task)."""
    direct = cfg.executor == "local" and cfg.procs_per_node() == 1
    env = {"MEGATRON_RL_HOME": str(HOME), "LAUNCHER": "direct" if direct else "torchrun"}
    if cfg.executor == "slurm":
        env["MRL_STOP_BEFORE_END_S"] = str(cfg.signal_lead())
    if cfg.venv:
        env["VENV"] = cfg.venv
    colocated = cfg.rollout_placement == "colocated" and uses_servers(cfg)
    if engines or colocated:  # node_launch.sh starts `megatron-rl engines $MRL_ENGINE_ARGS`
        value = " ".join(engine_args(cfg, run_dir))
        # NeMo-Run writes `export NAME=value` as is: quote it, letting the job's variables expand
        env["MRL_ENGINE_ARGS"] = f'"{value}"' if cfg.executor == "slurm" else value
    return {**env, **cfg.env}


def make_task(cfg: LaunchConfig, stage: str, run_dir: Path, *, engines: bool = False):
    import nemo_run as run

    command = ["--engines"] if engines else node_command(cfg, stage, run_dir)
    if cfg.executor == "slurm":
        command = [shlex.quote(str(NODE_LAUNCH)), *command]
    else:
        command = [str(NODE_LAUNCH), *command]
    return run.Script(path=command[0], args=command[1:], entrypoint="bash")


def make_tasks(cfg: LaunchConfig, stage: str, run_dir: Path) -> list:
    """The trainer task, and (dedicated) the engine group's task."""
    tasks = [make_task(cfg, stage, run_dir)]
    if cfg.rollout_placement == "dedicated":
        tasks.append(make_task(cfg, stage, run_dir, engines=True))
    return tasks


def slurm_executor(cfg: LaunchConfig, run_dir: Path, *, engines: bool = False):
    import nemo_run as run

    mounts: list[str] = []
    if cfg.container_image:
        mounts = [f"{HOME}:{HOME}", f"{run_dir.parent}:{run_dir.parent}", *cfg.container_mounts]
    return run.SlurmExecutor(
        account=cfg.account or None,  # no --account line: clusters without accounting
        partition=cfg.partition or None,
        job_name_prefix="mrl-",
        nodes=cfg.rollout_nodes if engines else cfg.nodes,
        ntasks_per_node=1,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task or None,
        exclusive=True,
        time=cfg.time,
        container_image=cfg.container_image or None,
        container_mounts=mounts,
        env_vars=task_env(cfg, run_dir, engines=engines),
        retries=cfg.max_requeues,
        heterogeneous=cfg.rollout_placement == "dedicated",
        # The tunnel's job dir must be the experiment's own dir ($NEMORUN_HOME/experiments/...,
        # LocalTunnel's default): sbatch is given the script there and srun runs in its code/.
        tunnel=run.LocalTunnel(job_dir=""),
        packager=run.Packager(),  # the checkout is used in place (mounted when in a container)
    )


def local_executor(cfg: LaunchConfig, run_dir: Path):
    import nemo_run as run

    # node_launch.sh starts torchrun itself when nproc > 1, so NeMo-Run's own launcher stays off.
    return run.LocalExecutor(ntasks_per_node=1, env_vars=task_env(cfg, run_dir))


def make_executors(cfg: LaunchConfig, run_dir: Path) -> list:
    """One executor per task of :func:`make_tasks` (dedicated: the trainer group, the engine group)."""
    if cfg.executor != "slurm":
        return [local_executor(cfg, run_dir)]
    executors = [slurm_executor(cfg, run_dir)]
    if cfg.rollout_placement == "dedicated":
        executors.append(slurm_executor(cfg, run_dir, engines=True))
    return executors
