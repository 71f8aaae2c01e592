"""Rollout engines: the interface, its vLLM implementations and a factory."""

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig


def make_engine(model_path: str, cfg: RolloutConfig, *, seed: int = 0, **kwargs) -> RolloutEngine:
    """Build the engine ``cfg.engine`` names."""
    if cfg.engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, seed=seed, **kwargs)
    if cfg.engine == "vllm_remote":
        from megatron_rl.rollout.remote import RemoteEngine  # noqa: F401  (issue 6)

        return RemoteEngine(model_path, cfg, seed=seed, **kwargs)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")


__all__ = ["Completion", "RolloutEngine", "SamplingSpec", "RolloutConfig", "make_engine"]
