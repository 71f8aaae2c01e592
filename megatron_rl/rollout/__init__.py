"""Rollout engines: the interface, the in-process vLLM engine, vLLM servers and their fleet."""

from __future__ import annotations

import time

from megatron_rl.rollout.base import (PAUSE_MODES, UNKNOWN_VERSION, Completion, EngineDied, EngineError,
                                      EngineTimeout, PauseMode, RolloutEngine, SamplingSpec)
from megatron_rl.rollout.config import RolloutConfig


def make_engine(model_path: str, cfg: RolloutConfig, *, seed: int = 0, max_model_len: int | None = None,
                registry_dir: str | None = None, names: list[str] | None = None) -> RolloutEngine:
    """The engine ``cfg.engine`` names: the in-process engine, or the fleet of vLLM servers
    (found in ``registry_dir`` when launched, or at ``cfg.server_urls``)."""
    if cfg.engine == "vllm" and cfg.async_.needs_streaming:
        from megatron_rl.rollout.streaming import StreamingVLLMEngine

        return StreamingVLLMEngine(model_path, cfg, seed=seed, max_model_len=max_model_len)
    if cfg.engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, seed=seed, max_model_len=max_model_len)
    if cfg.engine == "vllm_server":
        return connect_fleet(cfg, registry_dir=registry_dir, names=names, max_model_len=max_model_len)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")


def connect_fleet(cfg: RolloutConfig, *, registry_dir: str | None = None, names: list[str] | None = None,
                  max_model_len: int | None = None):
    """Wait (up to ``rollout.start_timeout_s``) for the servers, then drive them as one fleet.

    ``external``: the servers at ``cfg.server_urls``; otherwise the ``cfg.num_engines`` engines the
    node launchers registered in ``registry_dir`` (exactly ``names`` when given). A server whose
    max model length is below ``max_model_len`` (the run's longest prompt + response) is refused."""
    from megatron_rl.rollout.fleet import EngineFleet
    from megatron_rl.rollout.registry import EngineRegistry
    from megatron_rl.rollout.server import VLLMServer, server_healthy

    locate = None
    if cfg.placement == "external":
        servers = [VLLMServer(url, cfg, name=f"engine{i}") for i, url in enumerate(cfg.server_urls)]
        deadline = time.monotonic() + cfg.start_timeout_s
        while True:
            missing = [s for s in servers if not s.health(timeout=5.0)]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise EngineError(f"rollout.server_urls: no answer from {[s.url for s in missing]} within "
                                  f"rollout.start_timeout_s={cfg.start_timeout_s:g}s")
            time.sleep(1.0)
    else:
        if not registry_dir:
            raise ValueError("vllm_server engines launched per node need the registry directory")

        registry = EngineRegistry(registry_dir)
        records = registry.wait(cfg.num_engines, names, cfg.start_timeout_s, ready=lambda rec: server_healthy(rec.url))
        servers = [VLLMServer(r.url, cfg, name=r.name, workers=r.workers) for r in records]

        def locate(name: str) -> str | None:
            rec = registry.records().get(name)
            return rec.url if rec is not None else None
    try:
        for i, server in enumerate(servers):
            server.connect()
            if max_model_len:
                server.require_model_len(max_model_len, f"rollout.server_urls[{i}]" if cfg.placement == "external"
                                         else "rollout.registry_dir")
    except BaseException:
        for server in servers:
            server.close()
        raise
    return EngineFleet(servers, cfg, locate=locate)


def group_stream(engine: RolloutEngine, streaming: bool):
    """The :class:`~megatron_rl.rollout.streaming.GroupStream` the async scheduler drives for ``engine``: the streaming in-process engine itself; the fleet
    of servers as a :class:`~megatron_rl.rollout.fleet_stream.FleetStream` (one named request per prompt,
    each group delivered as it finishes, leftovers stoppable: a preemption keeps the finished groups;
    the step trains them in draw order, so the samples and batches are those of one ``generate``);
    anything else through :class:`BackgroundGenerate` (a wave at once, in prompt order: today's
    loop exactly). ``streaming`` (partial rollouts, oversampling) needs one of the first two."""
    from megatron_rl.rollout.fleet import EngineFleet
    from megatron_rl.rollout.streaming import BackgroundGenerate, GroupStream

    if isinstance(engine, GroupStream):
        return engine
    if isinstance(engine, EngineFleet):
        from megatron_rl.rollout.fleet_stream import FleetStream

        return FleetStream(engine)
    return BackgroundGenerate(engine)


__all__ = ["PAUSE_MODES", "UNKNOWN_VERSION", "Completion", "EngineDied", "EngineError", "EngineTimeout",
           "PauseMode", "RolloutConfig", "RolloutEngine", "SamplingSpec", "connect_fleet", "group_stream",
           "make_engine"]
