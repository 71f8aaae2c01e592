"""Compatibility layer: the CPU shim for Megatron-Core and the Megatron fixes (the only code that
patches torch or Megatron).

:func:`apply_compat` is the one call every entry point makes (the CLI, torchrun workers, the test
fixtures), once, before anything of Megatron is built: the CPU shim where there is no CUDA, the
Megatron checkpoint fixes always. ``models.init_distributed`` refuses to start without it.
"""

from megatron_rl.compat.cpu_shim import apply_cpu_shim, cpu_shim_active, megatron_cpu_scope
from megatron_rl.compat.megatron_fixes import apply_megatron_fixes, megatron_fixes_applied


def apply_compat() -> bool:
    """Apply the CPU shim (a no-op with CUDA) and the Megatron fixes, idempotently; returns True
    when the CPU shim is active (the run then uses gloo)."""
    shim = apply_cpu_shim()
    apply_megatron_fixes()
    return shim


def compat_applied() -> bool:
    """Whether :func:`apply_compat` has run in this process."""
    return megatron_fixes_applied()


__all__ = ["apply_compat", "apply_cpu_shim", "apply_megatron_fixes", "compat_applied",
           "cpu_shim_active", "megatron_cpu_scope"]
