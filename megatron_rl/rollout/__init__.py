"""Rollout engines: the interface, its vLLM implementations and a factory."""

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.pool import EnginePool


def make_engines(model_path: str, cfg: RolloutConfig, *, seed: int = 0, **kwargs) -> list[RolloutEngine]:
    """``cfg.num_engines`` engines (remote ones boot concurrently), named engine0, engine1, ..."""
    if cfg.num_engines == 1:
        return [make_engine(model_path, cfg, seed=seed, **kwargs)]
    from megatron_rl.rollout.remote import RemoteEngine

    engines = [RemoteEngine(model_path, cfg, seed=seed + i, name=f"engine{i}", wait=False, **kwargs)
               for i in range(cfg.num_engines)]
    for e in engines:
        e.wait_ready()
    return engines


def make_engine(model_path: str, cfg: RolloutConfig, *, seed: int = 0, **kwargs) -> RolloutEngine:
    """Build the engine ``cfg.engine`` names."""
    if cfg.engine == "vllm" and cfg.async_.needs_streaming:
        from megatron_rl.rollout.streaming import StreamingVLLMEngine

        return StreamingVLLMEngine(model_path, cfg, seed=seed, **kwargs)
    if cfg.engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, seed=seed, **kwargs)
    if cfg.engine == "vllm_remote":
        from megatron_rl.rollout.remote import RemoteEngine  # noqa: F401  (issue 6)

        return RemoteEngine(model_path, cfg, seed=seed, **kwargs)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")


__all__ = ["Completion", "EnginePool", "RolloutEngine", "SamplingSpec", "RolloutConfig", "make_engine",
           "make_engines"]
