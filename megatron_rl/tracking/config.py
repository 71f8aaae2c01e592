"""Experiment tracking configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ranged


@dataclass(kw_only=True)
class RolloutDumpConfig(ConfigBase):
    # Write every GRPO step's samples to RUN_DIR/rollouts/step_<global step>.parquet.
    enabled: bool = True
    # Share of the prompts whose groups are dumped, picked by a hash of the prompt id (the same
    # prompts every step, so their pass-rate trajectories are whole).
    sample_rate: float = ranged(1.0, gt=0.0, le=1.0)
    # Stop dumping once RUN_DIR/rollouts/ holds this many GiB (0: no cap).
    max_gb: float = ranged(20.0, ge=0.0)
    # Dump prompt and response token ids (the largest columns; the texts are always dumped).
    token_ids: bool = True
    # Samples per step also logged to W&B as a table (0: none).
    wandb_samples: int = ranged(4, ge=0)


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
