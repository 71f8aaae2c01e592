"""Experiment tracking configuration."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.base import ConfigBase


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
    # Also write metrics to RUN_DIR/metrics.jsonl (always on for the demo's report).
    jsonl: bool = True

    def validate(self) -> None:
        super().validate()
        if self.wandb_mode not in ("offline", "online", "disabled"):
            self.fail("wandb_mode", f"must be offline, online or disabled, got {self.wandb_mode!r}")
