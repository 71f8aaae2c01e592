"""Typed configuration: per-component dataclasses, YAML loading with inheritance and overrides."""

from megatron_rl.config.base import ConfigBase, ConfigError
from megatron_rl.config.loader import apply_override, load_config

__all__ = ["ConfigBase", "ConfigError", "load_config", "apply_override"]
