"""Where a run's rollout engines come from, by ``rollout.engine`` and ``rollout.placement``.

- ``vllm``: one engine in the trainer's process (global rank 0).
- ``vllm_server``, ``colocated``: every trainer node runs ``rollout.engines_per_node`` vLLM servers
  for its own GPUs. ``slurm/node_launch.sh`` starts them (``megatron-rl engines``) before the trainer
  and marks that in the environment; otherwise the node's first trainer process starts them itself.
- ``vllm_server``, ``dedicated``: the ``rollout.hosts`` nodes run them, as their own srun step of the
  sbatch scripts (``megatron-rl engines`` on each).
- ``vllm_server``, ``external``: servers the user runs, at ``rollout.server_urls``.

Launched engines register in ``rollout.registry_dir`` (default RUN_DIR/engines); rank 0 waits for
the ones it expects (named ``<node>-<i>`` when the nodes are known) and drives them as one fleet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.rollout import RolloutEngine, make_engine
from megatron_rl.rollout.launcher import LAUNCHED_ENV, EngineLauncher, node_specs
from megatron_rl.rollout.registry import EngineRegistry, engine_name
from megatron_rl.rollout.routes import resolve_source, server_route_args
from megatron_rl.sync.base import server_args
from megatron_rl.trainer.schema import max_sequence_len

if TYPE_CHECKING:
    from megatron_rl.models.parallel import ParallelGroups
    from megatron_rl.trainer.schema import RunConfig

log = logging.getLogger("megatron_rl")

# Overrides of this node's name and address (the node launcher and the trainer must agree on them;
# the tests emulate several nodes on one host with them).
NODE_NAME_ENV = "MRL_NODE_NAME"
NODE_HOST_ENV = "MRL_NODE_HOST"


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname().split(".")[0]


def node_host() -> str:
    """The address this node's servers bind to and are reached at."""
    return os.environ.get(NODE_HOST_ENV) or socket.gethostname()


def registry_dir(cfg: RunConfig) -> Path:
    return Path(cfg.rollout.registry_dir or Path(cfg.trainer.run_dir) / "engines")


def check_external_servers(cfg: RunConfig, model_path: str | None = None, timeout: float = 5.0) -> None:
    """placement external: the servers listed once each, and those that already answer must be the
    vLLM servers the run needs (the routes it drives, the policy's model at ``model_path``, the run's
    longest prompt + response), checked before anything is built; one not up yet is checked when
    the fleet connects."""
    from megatron_rl.rollout import EngineError, check_distinct, check_server
    from megatron_rl.rollout.identity import health_or_refuse
    from megatron_rl.rollout.server import VLLMServer

    r = cfg.rollout
    if r.engine != "vllm_server" or r.placement != "external":
        return
    keys = [f"rollout.server_urls[{i}]" for i in range(len(r.server_urls))]
    check_distinct(r.server_urls, keys)
    need = max_sequence_len(cfg)
    for key, url in zip(keys, r.server_urls):
        if health_or_refuse(url, key, timeout):
            continue  # not up yet
        server = VLLMServer(url, r, name=key)
        try:
            check_server(server, key, need, model_path)
        except EngineError:
            continue
        finally:
            server.close()


def node_launcher(cfg: RunConfig, model_path: str, *, node: str | None = None, host: str | None = None,
                  count: int | None = None, gpus_per_engine: int | None = None) -> EngineLauncher:
    """The servers of one node, registered in the run's registry."""
    args, env = server_args(cfg.sync)
    if gpus_per_engine is None:
        gpus_per_engine = cfg.rollout.tensor_parallel_size if _has_gpus() else 0
    if cfg.algo.engine_routes:  # MoE routing replay: the servers return each token's routes
        args += server_route_args(args, resolve_source(cfg.rollout.routes_source, cuda=gpus_per_engine > 0))
    specs = node_specs(node=node or node_name(), host=host or node_host(),
                       count=count or cfg.rollout.engines_per_node, model=model_path, rollout=cfg.rollout,
                       max_model_len=max_sequence_len(cfg), seed=cfg.trainer.seed, extra_args=args, env=env,
                       log_dir=str(registry_dir(cfg) / "logs"), gpus_per_engine=gpus_per_engine)
    return EngineLauncher(specs, registry=EngineRegistry(registry_dir(cfg)),
                          start_timeout_s=cfg.rollout.start_timeout_s)


def colocated_launcher(cfg: RunConfig, model_path: str) -> EngineLauncher | None:
    """The engines this trainer process must start itself (not started yet): the node's, when the
    servers are colocated, this is the node's first trainer process and no node launcher did."""
    r = cfg.rollout
    if r.engine != "vllm_server" or r.placement != "colocated" or os.environ.get(LAUNCHED_ENV):
        return None
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    return node_launcher(cfg, model_path)


def start_colocated(cfg: RunConfig, model_path: str) -> EngineLauncher | None:
    """The node's first trainer process starts the node's engines, unless a node launcher did."""
    launcher = colocated_launcher(cfg, model_path)
    if launcher is None:
        return None
    launcher.start(wait=False)  # they boot while the policy is built
    log.info("started this node's %d rollout engines (colocated)", len(launcher.servers))
    return launcher


def expected_engines(cfg: RunConfig, groups: ParallelGroups) -> list[str] | None:
    """The names of the launched engines rank 0 waits for (None: only their number is known).
    Collective over the trainer ranks (colocated: every node says its name)."""
    r = cfg.rollout
    if r.placement == "colocated":
        local = node_name() if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
        nodes = [local]
        if groups.world_size > 1:
            import torch.distributed as dist

            from megatron_rl.models.parallel import named_collective

            nodes = [None] * groups.world_size
            with named_collective("every node's name (the engines rank 0 waits for)", groups.timeout_s):
                dist.all_gather_object(nodes, local)
        hosts = list(dict.fromkeys(n for n in nodes if n))
    elif r.placement == "dedicated":
        hosts = list(r.hosts)
    else:
        return None
    if not hosts:
        return None
    return [engine_name(h, i) for h in hosts for i in range(r.engines_per_node)]


def build_engine(cfg: RunConfig, model_path: str, names: list[str] | None) -> RolloutEngine:
    """Rank 0's engine: the in-process one, or the fleet of servers (waits for them)."""
    r = cfg.rollout
    if r.engine == "vllm_server" and r.placement != "external":
        if names is None and r.num_engines == 0:
            raise ValueError("rollout.num_engines=0 (every node's engines) needs the engine nodes: "
                             "rollout.hosts for placement 'dedicated'")
        if names is not None and r.num_engines not in (0, len(names)):
            raise ValueError(f"rollout.num_engines={r.num_engines}, but the nodes run {len(names)} engines "
                             f"({names}): set it to nodes x rollout.engines_per_node, or 0")
        if names is not None:
            r = dataclasses.replace(r, num_engines=len(names))
    return make_engine(model_path, r, seed=cfg.trainer.seed, max_model_len=max_sequence_len(cfg),
                       registry_dir=str(registry_dir(cfg)), names=names, return_routes=cfg.algo.engine_routes)


def _has_gpus() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False
