"""Generic machinery every package may use: the name registry and the metric reducer.

The bottom of the house (with ``compat`` and ``config``): it imports nothing from megatron_rl.
"""

from megatron_rl.common.metrics import reduce_metrics
from megatron_rl.common.registry import Registry

__all__ = ["Registry", "reduce_metrics"]
