"""Generic machinery every package may use: the name registry, the metric reducer, the base
class of the errors a user can fix (:class:`InputError`) and the subcommands' argument parser
(``cli_args``: its errors are InputErrors).

The bottom of the house (with ``compat`` and ``config``): it imports nothing from megatron_rl.
"""

from megatron_rl.common.errors import InputError
from megatron_rl.common.metrics import reduce_metrics
from megatron_rl.common.registry import Registry

__all__ = ["InputError", "Registry", "reduce_metrics"]
