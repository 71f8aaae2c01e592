"""A name -> entry registry: the one implementation behind algorithm variants and reward styles.

A new variant is one decorated function; the config names it, the caller looks it up by name. A
duplicate name is refused, an unknown name lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping of names to entries (functions, or records that hold one)."""

    def __init__(self, kind: str, hint: str = ""):
        self.kind = kind
        # Appended to the unknown-name error (how to add an entry).
        self.hint = hint
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``; the same entry again is a no-op, another one is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        old = self._entries.get(name)
        if old is not None and old != entry:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {_origin(old)})")
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

    def unknown_message(self, name: str) -> str:
        msg = f"unknown {self.kind} {name!r}; valid names are {sorted(self._entries)}"
        return f"{msg}; {self.hint}" if self.hint else msg

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown_message(name)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


def _origin(entry) -> str:
    fn = getattr(entry, "fn", entry)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
