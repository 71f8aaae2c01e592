"""Trainer -> rollout-engine weight sync: bucket packing, transports, verification."""

from megatron_rl.sync.base import (SyncError, SyncMetrics, SyncMismatch, SyncTimeout, WeightSync,
                                   build_weight_sync)
from megatron_rl.sync.config import SyncConfig

__all__ = ["SyncConfig", "SyncError", "SyncMetrics", "SyncMismatch", "SyncTimeout", "WeightSync",
           "build_weight_sync"]
