"""What a run records: metrics.jsonl, W&B (offline by default), console progress, rollout dumps, log routing."""

from megatron_rl.tracking.config import TrackingConfig
from megatron_rl.tracking.tracker import Tracker

__all__ = ["TrackingConfig", "Tracker"]
