"""What a job script needs from its run config, validated before anything runs or is submitted.

    python -m megatron_rl.tools.job_config --config CONFIG (--index N | --stage NAME) [--dedicated]
        [--world-size N [--world-from TEXT]] [key=value ...]

(``--config C --index N`` repeated: each stage's config is checked, nothing printed) prints three lines: the stage's name (``--stage``, or the N-th of the config's ``stages``), the
config's ``trainer.run_dir`` and its ``rollout.engine``. The config is loaded and validated with
the overrides the trainer will get (``--dedicated``: also the dedicated engine nodes'), so a bad
key or value is one line, ``megatron-rl: ...``, exit 2, in the job's log before any ``srun`` (or
before ``sbatch``), not one line per rank from inside torchrun. With ``--world-size`` (the job's
trainer processes: nodes x processes per node, ``--world-from`` says so) the layout and the engine are
checked against it too (``trainer.schema.check_world_size``: TP x PP x CP must divide it, the
in-process engine needs one process). ``slurm/common.sh`` and
``slurm/submit_recipe.sh`` run it; ``launch.run`` calls :func:`check_job_config`.
"""

from __future__ import annotations

import sys

from megatron_rl.common.cli_args import ArgumentParser, run_main
from megatron_rl.config.base import ConfigError
from megatron_rl.trainer.schema import RunConfig, check_world_size, load_run_config

# What a job with dedicated engine nodes adds for the trainer (the hosts are only known in the job).
DEDICATED = ["rollout.engine=vllm_server", "rollout.placement=dedicated", "rollout.num_engines=0",
             "rollout.hosts=[engine-host]"]


def check_job_config(config: str, overrides: list[str], *, stage: str = "", index: int | None = None,
                     dedicated: bool = False, world_size: int | None = None,
                     world_from: str = "") -> tuple[RunConfig, str]:
    """The validated run config and the name of the stage the job runs (``stage``, else the
    ``index``-th, 1-based, of the config's stages); with ``world_size``, checked against the job's
    number of trainer processes (``world_from``: where that number comes from)."""
    cfg = load_run_config(config, [*(DEDICATED if dedicated else []), *overrides])
    if world_size is not None:
        check_world_size(cfg, world_size, world_from or "the job's trainer processes")
    if stage:
        return cfg, cfg.stage(stage).name
    if index is None or not 1 <= index <= len(cfg.stages):
        raise ConfigError("stages", f"has {len(cfg.stages)} stages, no stage number {index}", source=config)
    return cfg, cfg.stages[index - 1].name


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m megatron_rl.tools.job_config", command="job config",
                       description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", required=True,
                   help="the run config (repeated with --index: several stages' configs checked at once)")
    p.add_argument("--index", type=int, action="append", default=None,
                   help="the stage's number in its config (1-based)")
    p.add_argument("--stage", default="", help="the stage's name (instead of --index)")
    p.add_argument("--dedicated", action="store_true", help="the rollout engines get their own nodes")
    p.add_argument("--world-size", type=int, default=None, help="the job's trainer processes (nodes x per node)")
    p.add_argument("--world-from", default="", help="where --world-size comes from (said when it does not fit)")
    p.add_argument("overrides", nargs="*")

    def go() -> int:
        a = p.parse_args(argv)
        indices = [None] * len(a.config) if a.stage else (a.index or [])
        if len(indices) != len(a.config):
            p.error(f"give --stage, or one --index per --config ({len(a.config)} configs, {len(indices)} indices)")
        for config, i in zip(a.config, indices):
            cfg, name = check_job_config(config, a.overrides, stage=a.stage, index=i, dedicated=a.dedicated,
                                         world_size=a.world_size, world_from=a.world_from)
        if len(a.config) == 1:
            print(name, cfg.trainer.run_dir, cfg.rollout.engine, sep="\n")
        return 0

    return run_main(go)


if __name__ == "__main__":
    sys.exit(main())
