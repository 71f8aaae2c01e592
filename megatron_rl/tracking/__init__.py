"""Metrics: W&B (offline by default), metrics.jsonl, console progress, the run report."""

from megatron_rl.tracking.config import TrackingConfig
from megatron_rl.tracking.tracker import Tracker

__all__ = ["TrackingConfig", "Tracker"]
