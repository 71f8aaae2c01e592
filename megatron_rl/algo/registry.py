"""Name -> function registries for advantage estimators and policy losses.

A new variant is one decorated function; the config names it, the trainer looks it up by name.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping


class Registry(Mapping[str, Callable]):
    """A read-only mapping of names to functions, filled by its ``register`` decorator."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: Callable) -> Callable:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"(by {self._fns[name].__module__}.{self._fns[name].__qualname__})")
            self._fns[name] = fn
            return fn

        return decorator

    def unknown_message(self, name: str) -> str:
        return f"unknown {self.kind} {name!r}; valid names are {sorted(self._fns)}"

    def __getitem__(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(self.unknown_message(name)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._fns)})"


# fn(rewards: float64[B], group_index: long[B] in [0, num_groups), in_stats: bool[B],
#    num_groups: int, cfg: AlgoConfig) -> float64[B] advantages.
ADV_ESTIMATORS = Registry("advantage estimator")
# fn(log_ratio: [b,T], advantages: [b,T], cfg: AlgoConfig) -> (per-token loss [b,T],
#    {event name: bool[b,T]}), events counted over valid tokens as fractions (e.g. clipfrac_low).
POLICY_LOSSES = Registry("policy loss")


def register_adv_estimator(name: str) -> Callable[[Callable], Callable]:
    return ADV_ESTIMATORS.register(name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    return POLICY_LOSSES.register(name)
