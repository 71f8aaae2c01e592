"""The ``megatron-rl`` command.

    megatron-rl train --config CONFIG.yaml [--stage NAME] [--run-dir DIR] [key.sub=value ...]
    megatron-rl demo  [--run-dir DIR] [key.sub=value ...]      # the built-in CPU demo
    megatron-rl engines --config CONFIG.yaml [--run-dir DIR]   # this node's vLLM servers (a node launcher)
    megatron-rl validate CONFIG.yaml [...]                     # load + validate configs
    megatron-rl data difficulty ...                            # label prompts by difficulty
    megatron-rl analyze RUN_DIR                                # the run report (HTML)

train and demo take --verbose: libraries' INFO logs on the console too (always in RUN_DIR/logs/).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.yaml"


def _setup_logging() -> None:
    """Our lines on the console (rank 0; warnings only elsewhere), libraries' INFO off it."""
    from megatron_rl.common.launch_env import rank_hint
    from megatron_rl.tracking.logs import quiet_vllm_console, set_console_verbose

    quiet_vllm_console()  # before anything imports vLLM
    rank = rank_hint()  # (checked in _train, before the world starts)
    try:
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, markup=False, log_time_format="[%X]")
        logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    except ImportError:  # pragma: no cover
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    set_console_verbose(False)


def model_dir(cfg) -> str:
    """The model the run starts from: ``model.path``, or the tiny model written into the run dir."""
    from megatron_rl.demo import tiny_model_dir

    return cfg.model.path or str(tiny_model_dir(cfg.trainer.run_dir))


def _train(config: str, run_dir: str | None, stage: str | None, overrides: list[str],
           verbose: bool = False) -> int:
    """The entry point of a run: config, CPU shim and Megatron fixes, process groups, the demo's
    inputs, the trainer's parts, signal handlers, then the stages."""
    from megatron_rl.tracking.logs import hold_early_records, quiet_native_console

    quiet_native_console(verbose)  # before anything imports torch: its C++ warnings off the console
    hold_early_records()  # libraries' import-time warnings (Megatron's TE / Apex fallback) go to run.log
    from megatron_rl.common.launch_env import read_launch_env
    from megatron_rl.compat import apply_compat
    from megatron_rl.config.base import make_dir
    from megatron_rl.demo import prepare_inputs
    from megatron_rl.models import init_distributed
    from megatron_rl.tracking.logs import hidden_warnings, route_logs
    from megatron_rl.trainer.context import build_context
    from megatron_rl.trainer.run import nothing_left, run
    from megatron_rl.trainer.schema import check_world_size, load_run_config
    from megatron_rl.trainer.stop import StopRequest

    launch = read_launch_env()  # torchrun's variables, the whole contract, before anything is read or made
    if run_dir is not None:  # ``--run-dir ''`` is refused by the config's check, never ignored
        overrides = [*overrides, f"trainer.run_dir={json.dumps(run_dir)}"]  # a YAML string, always
    if verbose:
        overrides = [*overrides, "tracking.console_libraries=true"]
    cfg = load_run_config(config, overrides)
    if stage:
        cfg.stage(stage)  # fail fast on an unknown stage, before anything is built
    # the number of trainer processes (torchrun's) against the layout and the engine, before the world starts
    check_world_size(cfg, launch.world_size)
    if nothing_left(cfg, stage):
        logging.getLogger("megatron_rl").info("%s: %s already finished; nothing to do", cfg.trainer.run_dir,
                                              f"stage {stage}" if stage else "every stage")
        return 0
    make_dir(cfg.trainer.run_dir, "trainer.run_dir", "the run directory")  # before the world starts
    if cfg.trainer.cpu_cores:  # before any thread starts: every one inherits the trainer's cores
        place_cpus(cfg, launch.world_size)
    apply_compat()  # the one call: the CPU shim (a no-op with CUDA) and the Megatron fixes
    groups = init_distributed(cfg.policy.parallel, seed=cfg.policy.seed)
    logs = route_logs(cfg.trainer.run_dir, verbose=cfg.tracking.console_libraries, rank=groups.rank)
    if groups.rank == 0:
        logging.getLogger("megatron_rl").info("libraries' logs: %s", logs)
    model_path = model_dir(cfg)
    if groups.rank == 0:
        prepare_inputs(cfg.trainer.run_dir, tiny=None if cfg.model.path else cfg.model.tiny,
                       synthetic=cfg.synthetic, seed=cfg.trainer.seed)
    groups.barrier()
    stop = StopRequest()
    ctx = build_context(cfg, groups, model_path, stop)
    stop.install_signal_handlers()  # after the engines are built, so nothing replaces them
    code = run(ctx, only_stage=stage)
    if groups.rank == 0 and hidden_warnings():
        logging.getLogger("megatron_rl").info("libraries logged %d warnings, kept off the console: %s",
                                              hidden_warnings(), logs)
    return code


def place_cpus(cfg, world_size: int = 1) -> None:
    """``trainer.cpu_cores``: this (single) trainer process on its cores, its helpers and servers on the
    others (``common/cpus.py``); a core it may not use, or several ranks, is a config error."""
    from megatron_rl.common.cpus import place_trainer

    if world_size > 1:
        cfg.trainer.fail("cpu_cores", "pins one trainer process to its cores; a run of several ranks "
                         "(torchrun) would pin them all to the same ones")
    try:
        place_trainer(cfg.trainer.cpu_cores)
    except ValueError as exc:
        cfg.trainer.fail("cpu_cores", str(exc))


def _engines(config: str, run_dir: str | None, node: str | None, host: str | None, count: int | None,
             overrides: list[str]) -> int:
    """Run this node's rollout engines (vLLM servers) until SIGTERM / SIGINT: started together,
    registered in the run's engine registry, restarted if one exits. What slurm/node_launch.sh
    (colocated) and the sbatch scripts' engine step (dedicated) run on each node."""
    import signal
    import threading
    import time

    from megatron_rl.common.errors import InputError
    from megatron_rl.config.base import make_dir
    from megatron_rl.demo import tiny_model_dir
    from megatron_rl.trainer.engines import node_launcher, registry_dir
    from megatron_rl.trainer.schema import load_run_config

    if run_dir:
        overrides = [*overrides, f"trainer.run_dir={run_dir}"]
    cfg = load_run_config(config, overrides)
    if cfg.rollout.engine != "vllm_server":
        raise InputError(f"engines: the config runs rollout.engine={cfg.rollout.engine!r} (in the "
                         "trainer's process); nothing to launch")
    check_engine_node(node, host, count)
    make_dir(cfg.trainer.run_dir, "trainer.run_dir", "the run directory")  # before any wait or server
    make_dir(registry_dir(cfg), "rollout.registry_dir", "the engine registry")
    model_path = cfg.model.path or str(tiny_model_dir(cfg.trainer.run_dir))
    deadline = time.monotonic() + cfg.rollout.start_timeout_s
    # the demo's tiny model is written by the trainer's rank 0; tiny_spec.json is its last file
    done = Path(model_path) / ("config.json" if cfg.model.path else "tiny_spec.json")
    while not done.exists():
        if time.monotonic() > deadline:
            raise InputError(f"engines: no model at {model_path} after "
                             f"rollout.start_timeout_s={cfg.rollout.start_timeout_s:g}s")
        time.sleep(1.0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    launcher = node_launcher(cfg, model_path, node=node, host=host, count=count)
    try:
        launcher.start()
        for server in launcher.servers:
            print(f"engine {server.spec.name} at {server.spec.url()}", flush=True)
        launcher.supervise(stop)
    finally:
        launcher.stop()
    return 0


def check_engine_node(node: str | None, host: str | None, count: int | None) -> None:
    """``megatron-rl engines``' own inputs: the node's name names its engines' registry files (and
    the trainer expects it), the host is bound to, the count starts that many servers."""
    import re

    from megatron_rl.common.errors import InputError
    from megatron_rl.trainer.engines import NODE_HOST_ENV, NODE_NAME_ENV, node_host, node_name

    if count is not None and count < 1:
        raise InputError(f"engines: --count must be >= 1, got {count}")
    name = node or node_name()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise InputError(f"engines: the node name {name!r} (--node-name, else ${NODE_NAME_ENV}) must be letters, "
                         f"digits, '.', '_' or '-' (it names the engines' registry files)")
    address = host or node_host()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*", address):
        raise InputError(f"engines: the host {address!r} (--host, else ${NODE_HOST_ENV}) is no host name or address")


# Exit code of a run stopped by trainer.max_steps_without_update (2: a config error, 99: requeue).
NO_UPDATE_EXIT_CODE = 3


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. An :class:`~megatron_rl.common.errors.InputError` (a config value, data
    file, model or checkpoint that cannot work) is printed as one line, ``megatron-rl: ...``, and
    the exit code is 2; a run that trains nothing (:class:`~megatron_rl.trainer.no_update.NoUpdateStop`)
    prints its diagnosis the same way with exit code 3; any other exception is a bug and keeps its
    traceback."""
    from megatron_rl.common.cli_args import report, run_main
    from megatron_rl.trainer.no_update import NoUpdateStop

    try:
        return run_main(lambda: _main(list(sys.argv[1:] if argv is None else argv)))
    except NoUpdateStop as exc:
        report(exc)
        return NO_UPDATE_EXIT_CODE


def _main(argv: list[str]) -> int:
    from megatron_rl.common.cli_args import PROGRAM, ArgumentParser

    if argv[:2] == ["data", "difficulty"]:  # its own option parser (argparse.REMAINDER drops --options)
        _setup_logging()
        from megatron_rl.tools.difficulty import cli_main

        return cli_main(argv[2:])
    p = ArgumentParser(prog=PROGRAM, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    t = sub.add_parser("train", help="run GRPO stages from a config")
    t.add_argument("--config", required=True)
    t.add_argument("--stage", default=None, help="run only this stage (default: all, in order)")
    t.add_argument("--run-dir", default=None)
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    d = sub.add_parser("demo", help="the built-in CPU demo: SFT cold start + multi-stage GRPO on a tiny model")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("overrides", nargs="*")
    e = sub.add_parser("engines", help="run this node's rollout engines (vLLM servers) until stopped")
    e.add_argument("--config", required=True)
    e.add_argument("--run-dir", default=None)
    e.add_argument("--node-name", default=None, help="names the engines <node>-<i> (default: the host name)")
    e.add_argument("--host", default=None, help="address the servers bind to (default: this host's name)")
    e.add_argument("--count", type=int, default=None, help="engines on this node (default: rollout.engines_per_node)")
    e.add_argument("overrides", nargs="*")
    for sp in (t, d):
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="libraries' INFO logs (vLLM, ...) on the console too (tracking.console_libraries)")
    a = sub.add_parser("analyze", help="write RUN_DIR/report/index.html (the run report); the last "
                                       "output line is a JSON summary")
    a.add_argument("run_dir")
    a.add_argument("--out", default=None, help="report directory (default: RUN_DIR/report)")
    v = sub.add_parser("validate", help="load and validate config files")
    v.add_argument("configs", nargs="+")
    dd = sub.add_parser("data", help="data tools")
    dsub = dd.add_subparsers(dest="data_cmd", required=True, metavar="TOOL")
    dsub.add_parser("difficulty", help="label prompts solved / unsolved / hard / suspected wrong label "
                                       "(`megatron-rl data difficulty --help`)")
    args = p.parse_args(argv)

    _setup_logging()
    if args.cmd == "train":
        return _train(args.config, args.run_dir, args.stage, args.overrides, args.verbose)
    if args.cmd == "engines":
        return _engines(args.config, args.run_dir, args.node_name, args.host, args.count, args.overrides)
    if args.cmd == "demo":
        return _train(str(DEMO_CONFIG), args.run_dir, None, args.overrides, args.verbose)
    if args.cmd == "analyze":
        from megatron_rl.analysis.report import main as analyze_main

        return analyze_main(args.run_dir, args.out)
    if args.cmd == "validate":
        from megatron_rl.trainer.schema import load_run_config

        for c in args.configs:
            load_run_config(c)
            print(f"ok  {c}")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
