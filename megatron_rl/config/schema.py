"""The whole run's configuration: one typed section per component, and the cross-component checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.config.base import ConfigBase, ConfigError
from megatron_rl.data.config import DataConfig
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.tiny import TinySpec
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.sync.config import SyncConfig
from megatron_rl.tracking.config import TrackingConfig
from megatron_rl.trainer.config import EvalConfig, SFTConfig, StageConfig, TrainerConfig


@dataclass(kw_only=True)
class ModelConfig(ConfigBase):
    # Hugging Face checkpoint directory (Qwen2 / Qwen3 / Llama). Empty with ``tiny`` set: build one.
    path: str = ""
    # Build a tiny random model into RUN_DIR/base_model when ``path`` is empty.
    tiny: TinySpec | None = None

    def validate(self) -> None:
        super().validate()
        if not self.path and self.tiny is None:
            self.fail("path", "set model.path to a Hugging Face checkpoint, or model.tiny to build one")


@dataclass(kw_only=True)
class SyntheticConfig(ConfigBase):
    """Generate the built-in addition task's data (the demo) into RUN_DIR/data."""

    # Write RUN_DIR/data/{train,eval}.jsonl (verl format) if they do not exist yet.
    enabled: bool = False
    # Training problems (distinct).
    train_size: int = 20000
    # Held-out problems, drawn from a disjoint part of the problem space (never trained on).
    eval_size: int = 500
    # Operand sizes in digits.
    min_digits: int = 2
    max_digits: int = 3

    def validate(self) -> None:
        super().validate()
        self.check_range("train_size", lo=1)
        self.check_range("eval_size", lo=1)


@dataclass(kw_only=True)
class RunConfig(ConfigBase):
    # The starting checkpoint.
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # Multi-stage GRPO; each stage sets its max response length and step budget.
    stages: list[StageConfig] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        validate_cross(self)

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError("stages", f"no stage named {name!r}; stages are {[s.name for s in self.stages]}")


def validate_cross(cfg: RunConfig) -> None:
    """Checks that span components (each component checks its own fields in its validate)."""
    if not cfg.stages:
        raise ConfigError("stages", "at least one stage is required")
    names = [s.name for s in cfg.stages]
    if len(set(names)) != len(names):
        raise ConfigError("stages", f"stage names must be unique, got {names}")
    if cfg.sync.transport in ("gloo", "nccl") and cfg.rollout.engine != "vllm_remote":
        raise ConfigError("sync.transport", f"'{cfg.sync.transport}' joins engines in their own processes: "
                                            "it needs rollout.engine='vllm_remote'")
    n_mb = cfg.algo.mini_batches
    if cfg.rollout.rollout_batch_size % n_mb:
        raise ConfigError("algo.mini_batches", f"must divide rollout.rollout_batch_size="
                                               f"{cfg.rollout.rollout_batch_size}, got {n_mb}")
