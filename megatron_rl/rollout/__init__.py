"""Rollout engines: the interface, the in-process vLLM engine, vLLM servers and their fleet."""

from __future__ import annotations

import time

from megatron_rl.rollout.base import (PAUSE_MODES, UNKNOWN_VERSION, Completion, EngineDied, EngineError,
                                      EngineTimeout, PauseMode, RolloutEngine, SamplingSpec)
from megatron_rl.rollout.config import RolloutConfig


def make_engine(model_path: str, cfg: RolloutConfig, *, seed: int = 0, max_model_len: int | None = None,
                registry_dir: str | None = None, names: list[str] | None = None,
                return_routes: bool = False) -> RolloutEngine:
    """The engine ``cfg.engine`` names: the in-process engine, or the fleet of vLLM servers
    (found in ``registry_dir`` when launched, or at ``cfg.server_urls``). ``return_routes``: every
    completion carries its MoE routes (``Completion.routes``, :mod:`megatron_rl.rollout.routes`)."""
    if cfg.engine == "vllm" and cfg.async_.needs_streaming:
        from megatron_rl.rollout.streaming import StreamingVLLMEngine

        return StreamingVLLMEngine(model_path, cfg, seed=seed, max_model_len=max_model_len,
                                   return_routes=return_routes)
    if cfg.engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, seed=seed, max_model_len=max_model_len, return_routes=return_routes)
    if cfg.engine == "vllm_server":
        return connect_fleet(cfg, registry_dir=registry_dir, names=names, max_model_len=max_model_len,
                             model_path=model_path, return_routes=return_routes)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")


def connect_fleet(cfg: RolloutConfig, *, registry_dir: str | None = None, names: list[str] | None = None,
                  max_model_len: int | None = None, model_path: str | None = None,
                  return_routes: bool = False):
    """Wait (up to ``rollout.start_timeout_s``) for the servers, then drive them as one fleet.

    ``external``: the servers at ``cfg.server_urls``; otherwise the ``cfg.num_engines`` engines the
    node launchers registered in ``registry_dir`` (exactly ``names`` when given). Refused, naming
    the config key, the URL and what is wrong (:mod:`megatron_rl.rollout.identity`): a URL where
    another service answers, the same server twice, a vLLM server without the routes the trainer
    drives, one whose max model length is below ``max_model_len`` (the run's longest prompt +
    response) or that serves another model than the policy's at ``model_path``; with
    ``return_routes``, one that cannot return MoE routes. With ``model_path`` the servers return
    tokens only and the handles decode the texts with its tokenizer (``server.completion_text``)."""
    from megatron_rl.rollout.fleet import EngineFleet
    from megatron_rl.rollout.server import VLLMServer

    # The policy's tokenizer: the servers return tokens only, the handles decode the texts.
    tokenizer = None
    if model_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    locate = None
    if cfg.placement == "external":
        keys = [f"rollout.server_urls[{i}]" for i in range(len(cfg.server_urls))]
        check_distinct(cfg.server_urls, keys)
        servers = [VLLMServer(url, cfg, name=f"engine{i}", return_routes=return_routes, tokenizer=tokenizer)
                   for i, url in enumerate(cfg.server_urls)]
        whos = [s.url for s in servers]
        wait_healthy(servers, keys, cfg.start_timeout_s, "rollout.start_timeout_s")
    else:
        if not registry_dir:
            raise ValueError("vllm_server engines launched per node need the registry directory")
        from megatron_rl.rollout.registry import EngineRegistry
        from megatron_rl.rollout.server_http import server_healthy

        registry = EngineRegistry(registry_dir)
        records = registry.wait(cfg.num_engines, names, cfg.start_timeout_s, ready=lambda rec: server_healthy(rec.url))
        keys = ["rollout.registry_dir"] * len(records)
        whos = [f"engine {r.name} at {r.url} ({registry.path(r.name)})" for r in records]
        check_distinct([r.url for r in records], keys, whos)
        servers = [VLLMServer(r.url, cfg, name=r.name, workers=r.workers, return_routes=return_routes,
                              tokenizer=tokenizer) for r in records]

        def locate(name: str) -> str | None:
            rec = registry.records().get(name)
            return rec.url if rec is not None else None
    try:
        for key, who, server in zip(keys, whos, servers):
            check_server(server, key, max_model_len, model_path, who)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return EngineFleet(servers, cfg, locate=locate)


def check_distinct(urls: list[str], keys: list[str], whos: list[str] | None = None) -> None:
    """Refuse the same server listed twice (also two host names of one address); ``whos`` name
    them (default: the URLs and their keys)."""
    from megatron_rl.config.base import ConfigError
    from megatron_rl.rollout.addresses import same_resolved, same_servers

    pairs = same_servers(urls) or same_resolved(urls)
    if pairs:
        i, j = pairs[0]
        whos = whos or [f"{u} ({k})" for u, k in zip(urls, keys)]
        raise ConfigError(keys[j], f"{whos[j]} is the same server as {whos[i]}: each server is counted once")


def wait_healthy(servers: list, keys: list[str], timeout_s: float, timeout_key: str) -> None:
    """Wait until every server answers ``/health``; a service that answers anything else than a
    starting vLLM server is refused at once, one that stays silent at the deadline, each with what it
    answered."""
    from megatron_rl.config.base import ConfigError
    from megatron_rl.rollout.identity import health_or_refuse

    deadline = time.monotonic() + timeout_s
    while True:
        last = {}
        for key, server in zip(keys, servers):
            what = health_or_refuse(server.url, key, min(5.0, server.cfg.control_timeout_s))
            if what:
                last[key] = f"{server.url}: {what}"
        if not last:
            return
        if time.monotonic() > deadline:
            raise ConfigError(next(iter(last)), f"no vLLM server answered within {timeout_key}={timeout_s:g}s: "
                                                + "; ".join(last.values()))
        time.sleep(1.0)


def check_server(server, key: str, max_model_len: int | None = None, model_path: str | None = None,
                 who: str | None = None) -> None:
    """Connect ``server`` (a :class:`~megatron_rl.rollout.server.VLLMServer` that answered
    ``/health``) after checking it is the vLLM server the run needs (see :func:`connect_fleet`);
    ``key`` is the config key it comes from, ``who`` names it in a refusal (default: its URL)."""
    from megatron_rl.rollout.identity import check_model, check_service, policy_shape

    timeout = server.cfg.control_timeout_s
    check_service(server.url, key, timeout, who)
    server.connect()
    if max_model_len:
        server.require_model_len(max_model_len, key)
    if model_path:
        check_model(server, key, policy_shape(model_path), model_path, timeout, who)


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
           "PauseMode", "RolloutConfig", "RolloutEngine", "SamplingSpec", "check_server", "connect_fleet",
           "group_stream", "make_engine"]
