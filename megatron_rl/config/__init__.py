"""Typed-config machinery (the bottom of the house; it knows no component).

``base.py``: :class:`ConfigBase` (keyword-only dataclasses that refuse unknown keys) and
:class:`ConfigError`; ``loader.py``: YAML with ``defaults:`` inheritance and dotted overrides into
any config class; ``reference.py``: the key reference rendered from the field comments. Each
component declares its config in its own ``config.py``; the run's schema, which joins them all, is
``megatron_rl.trainer.schema``.
"""

from megatron_rl.config.base import ConfigBase, ConfigError
from megatron_rl.config.loader import apply_override, load, load_yaml_tree

__all__ = ["ConfigBase", "ConfigError", "apply_override", "load", "load_yaml_tree"]
