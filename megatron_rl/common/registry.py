"""A name -> entry registry: the one implementation behind algorithm variants and reward styles.

A new variant is one decorated function; the config names it, the caller looks it up by name. A
duplicate name is refused, an unknown name lists the valid ones.

The built-in entries may be *declared*: their names with the module whose decorators register them.
A declared name is known (listed, validated by a config) without importing that module; its first
lookup imports it. So checking a config's choice of variant does not import torch (the modules
that hold the variants do). vLLM's model registry declares its architectures the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping of names to entries (functions, or records that hold one)."""

    def __init__(self, kind: str, hint: str = "", *, declared: Mapping[str, str] | None = None):
        self.kind = kind
        # Appended to the unknown-name error (how to add an entry).
        self.hint = hint
        self._entries: dict[str, T] = {}
        # name -> the module that registers it when imported (imported at the name's first lookup)
        self._declared: dict[str, str] = dict(declared or {})

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``; the same entry again is a no-op, another one is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        old = self._entries.get(name)
        if old is not None and old != entry:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {_origin(old)})")
        owner = self._declared.get(name)
        if old is None and owner is not None and _module(entry) != owner:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {owner})")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`: ``@REGISTRY.register("name")``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        return lambda entry: self.add(name, entry)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register a temporary entry)."""
        self._entries.pop(name, None)
        self._declared.pop(name, None)

    def is_declared(self, name: str) -> bool:
        """Whether ``name`` is a built-in entry (declared with the module that registers it)."""
        return name in self._declared

    def unknown_message(self, name: str) -> str:
        msg = f"unknown {self.kind} {name!r}; valid names are {sorted(self)}"
        return f"{msg}; {self.hint}" if self.hint else msg

    def __getitem__(self, name: str) -> T:
        if name not in self._entries and name in self._declared:
            importlib.import_module(self._declared[name])  # its decorators register the name
            if name not in self._entries:
                raise LookupError(f"{self.kind} {name!r}: {self._declared[name]} is declared to register "
                                  f"it, and did not")
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown_message(name)) from None

    def __contains__(self, name: object) -> bool:  # a name, without importing its module
        return name in self._entries or name in self._declared

    def __iter__(self) -> Iterator[str]:
        return iter({**self._declared, **self._entries})

    def __len__(self) -> int:
        return len({**self._declared, **self._entries})

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self)})"


def _module(entry) -> str:
    return getattr(getattr(entry, "fn", entry), "__module__", "?")


def _origin(entry) -> str:
    fn = getattr(entry, "fn", entry)
    return f"{_module(entry)}.{getattr(fn, '__qualname__', repr(fn))}"
