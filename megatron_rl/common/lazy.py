"""Lazy package exports (PEP 562): a package's ``__init__`` names what it offers without importing it.

    __getattr__, __dir__ = lazy_exports(__name__, {"compute_advantages": "advantages", ...})

``from megatron_rl.algo import compute_advantages`` imports ``megatron_rl.algo.advantages`` then,
not when the package is imported; so importing a package's config (``megatron_rl.algo.config``)
does not import what its other modules need (torch, megatron, vllm).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a name to the submodule
    (relative to ``package``) that defines it; each is imported at its name's first use."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
