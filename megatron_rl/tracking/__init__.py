"""What a run records: metrics.jsonl, W&B (offline by default), console progress, rollout dumps, log routing.

``Tracker`` is imported at first use (``common.lazy``): the run schema reads ``tracking.config``
without importing pyarrow or wandb."""

from megatron_rl.common.lazy import lazy_exports

_EXPORTS = {"TrackingConfig": "config", "Tracker": "tracker"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
