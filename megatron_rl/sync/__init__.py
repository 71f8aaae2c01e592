"""Trainer -> rollout-engine weight sync: bucket packing, transports, verification."""

from megatron_rl.common.lazy import lazy_exports

# imported at first use (common.lazy): the run schema reads sync.config without torch
_EXPORTS = {
    "SyncError": "base", "SyncMetrics": "base", "SyncMismatch": "base", "SyncTimeout": "base",
    "WeightSync": "base", "build_weight_sync": "base", "SyncConfig": "config",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
