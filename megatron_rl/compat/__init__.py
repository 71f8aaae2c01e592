"""Compatibility layer: the CPU shim for Megatron-Core (the only module that patches torch)."""

from megatron_rl.compat.cpu_shim import apply_cpu_shim, cpu_shim_active, megatron_cpu_scope

__all__ = ["apply_cpu_shim", "cpu_shim_active", "megatron_cpu_scope"]
