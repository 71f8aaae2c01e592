"""Experiment tracking configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase
from megatron_rl.tracking.rollouts import RolloutDumpConfig


@dataclass(kw_only=True)
class TrackingConfig(ConfigBase):
    # W&B mode: "offline" (default; no key needed, sync later with `wandb sync`), "online", "disabled".
    wandb_mode: str = "offline"
    wandb_project: str = "megatron-rl"
    # Run name; defaults to the run directory's name.
    wandb_name: str = ""
    wandb_entity: str = ""
    # Console progress bar and per-step summary line.
    console: bool = True
    # Show libraries' INFO logs (vLLM, transformers, Megatron, ...) and Python warnings on the
    # console too (`--verbose`); they always go to RUN_DIR/logs/run.log.
    console_libraries: bool = False
    # Also write metrics to RUN_DIR/metrics.jsonl (always on for the demo's report).
    jsonl: bool = True
    # Rollout dumps: every GRPO step's samples as parquet under RUN_DIR/rollouts/.
    rollouts: RolloutDumpConfig = field(default_factory=RolloutDumpConfig)

    def validate(self) -> None:
        super().validate()
        if self.wandb_mode not in ("offline", "online", "disabled"):
            self.fail("wandb_mode", f"must be offline, online or disabled, got {self.wandb_mode!r}")
