"""What the NeMo-Run launcher needs to start one stage of the recipe (typed, validated)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config.base import ConfigBase, ranged

#: The checkout (configs/, slurm/ are found relative to it).
HOME = Path(__file__).resolve().parent.parent

#: Stage number -> seconds before the time limit at which the trainer is asked to checkpoint (as in
#: slurm/stage*.sh: longer stages have longer steps, so they are warned earlier).
SIGNAL_LEAD_SECONDS = {1: 600, 2: 900, 3: 1200}


@dataclass(kw_only=True)
class LaunchConfig(ConfigBase):
    # Which stage of the recipe: 1 (8k), 2 (16k) or 3 (32k). Picks configs/skywork_or1/<size>/stageN.yaml
    # and, unless ``stage_name`` is set, the N-th entry of that config's ``stages``.
    stage: int = ranged(ge=1, le=3)
    # Model size of the recipe configs: "7b" or "32b".
    size: str = "7b"
    # Run config; empty: configs/skywork_or1/<size>/stage<stage>.yaml. Relative paths: to the checkout.
    config: str = ""
    # Name of the stage to run; empty: the stage-th entry of the config's ``stages``.
    stage_name: str = ""
    # Run directory shared by the stages; empty: the config's trainer.run_dir.
    run_dir: str = ""
    # More ``key.sub=value`` config overrides for the trainer.
    overrides: list[str] = field(default_factory=list)
    # "slurm" (sbatch through NeMo-Run, pyxis container optional) or "local" (this machine).
    executor: str = "slurm"
    # Slurm: trainer nodes of the job; each runs torchrun for the trainer (and, colocated, its engines).
    nodes: int = ranged(1, ge=1)
    # Slurm: GPUs requested per node.
    gpus_per_node: int = ranged(8, ge=1)
    # Slurm: CPUs per task (one task per node); 0: the cluster's default.
    cpus_per_task: int = ranged(0, ge=0)
    # Trainer processes per node; 0: gpus_per_node for Slurm, 1 for local.
    nproc_per_node: int = ranged(0, ge=0)
    # Slurm account and partition (account is required by sbatch on most clusters).
    account: str = ""
    partition: str = ""
    # Slurm time limit of one job (a requeued job gets it again).
    time: str = "48:00:00"
    # Slurm: seconds before the time limit at which the trainer is told to checkpoint (USR1);
    # 0: the stage's default (600 / 900 / 1200 s).
    signal_lead_s: int = ranged(0, ge=0)
    # Slurm: requeue after a checkpoint-on-signal (or a failure) at most this many times.
    max_requeues: int = ranged(50, ge=0)
    # Slurm: pyxis/enroot image ("" = no container) and extra mounts "src:dst".
    container_image: str = ""
    container_mounts: list[str] = field(default_factory=list)
    # Environment variables for the trainer processes.
    env: dict[str, str] = field(default_factory=dict)
    # Virtualenv activated on every node before the trainer starts ("" = the PATH as is).
    venv: str = ""
    # torchrun rendezvous port on the first node; 0: 20000 + job id mod 20000 (as slurm/common.sh), so
    # two jobs sharing a node never pick the same port.
    master_port: int = ranged(0, ge=0, le=65535)
    # NEMORUN_HOME of this launch: NeMo-Run keeps each job's sbatch script and logs under
    # <job_dir>/experiments/<experiment>/<experiment id>/<stage>/; empty: $NEMORUN_HOME when set,
    # else <run_dir>/nemorun.
    job_dir: str = ""
    # Rollout engines (when the config's rollout.engine is vllm_server): "colocated" (every trainer
    # node also runs the engines for its GPUs) or "dedicated" (``rollout_nodes`` more nodes run only
    # engines: a heterogeneous Slurm job of a trainer group and an engine group).
    rollout_placement: str = "colocated"
    # Slurm, dedicated: nodes of the engine group (in addition to ``nodes`` trainer nodes).
    rollout_nodes: int = ranged(1, ge=1)

    def validate(self) -> None:
        super().validate()
        if self.size not in ("7b", "32b"):
            self.fail("size", f"must be '7b' or '32b', got {self.size!r}")
        if self.executor not in ("slurm", "local"):
            self.fail("executor", f"must be 'slurm' or 'local', got {self.executor!r}")
        if self.rollout_placement not in ("colocated", "dedicated"):
            self.fail("rollout_placement", f"must be 'colocated' or 'dedicated', got {self.rollout_placement!r}")
        if self.rollout_placement == "dedicated":
            if self.executor != "slurm":
                self.fail("rollout_placement", "'dedicated' puts the engines on nodes of their own: Slurm only")
        if self.executor == "local" and self.nodes != 1:
            self.fail("nodes", f"the local executor runs on this machine only (nodes=1), got {self.nodes}")
        for i, m in enumerate(self.container_mounts):
            if ":" not in m:
                self.fail("container_mounts", f"entry {i} must look like src:dst, got {m!r}")
        for o in self.overrides:
            if "=" not in o:
                self.fail("overrides", f"each override looks like key.sub=value, got {o!r}")
        if not self.config_path().is_file():
            self.fail("config", f"file not found: {self.config_path()}")
        if not re.fullmatch(r"\d+(-\d+)?(:\d+){0,2}|unlimited|infinite", self.time, flags=re.IGNORECASE):
            self.fail("time", f"must be a Slurm time limit (minutes, [D-]HH:MM:SS, ...), got {self.time!r}")
        if self.venv and not self.container_image and not (Path(self.venv) / "bin" / "activate").is_file():
            # (in a container the image holds it; otherwise the nodes see this file system)
            self.fail("venv", f"no virtualenv at {self.venv!r} (no bin/activate in it)")

    # --- derived values --------------------------------------------------------------------------
    def config_path(self) -> Path:
        path = Path(self.config or f"configs/skywork_or1/{self.size}/stage{self.stage}.yaml")
        return path if path.is_absolute() else HOME / path

    def procs_per_node(self) -> int:
        if self.nproc_per_node:
            return self.nproc_per_node
        return self.gpus_per_node if self.executor == "slurm" else 1

    def signal_lead(self) -> int:
        return self.signal_lead_s or SIGNAL_LEAD_SECONDS[self.stage]

    def check_script_paths(self, paths: dict[str, str]) -> None:
        """Refuse paths that NeMo-Run's Slurm script cannot carry (``paths``: field -> value).

        Without a container, NeMo-Run writes the sbatch script with the placeholder ``/nemo_run``
        for the job directory and then replaces every ``/nemo_run`` in the whole script, so any
        path containing it (a run directory ``.../nemo_run/...``) would come out doubled.
        """
        if self.executor != "slurm" or self.container_image:
            return
        for name, value in paths.items():
            if "/nemo_run" in value:
                self.fail(name, f"{value!r} contains '/nemo_run', which NeMo-Run's Slurm script "
                                "generator replaces with the job directory (without a container); "
                                "choose a path without it")
