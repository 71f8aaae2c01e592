"""The one metric reducer: keys ending in ``_min`` / ``_max`` reduce with min / max, others add up."""

from __future__ import annotations

from collections.abc import Iterable


def reduce_metrics(dicts: Iterable[dict[str, float]], *, mean: bool = False) -> dict[str, float]:
    """Reduce metric dicts key by key: ``_min`` keys by min, ``_max`` keys by max, the rest by sum
    (``mean=True``: the sum divided by the number of dicts, e.g. the optimizer steps of an update)."""
    out: dict[str, float] = {}
    n = 0
    for d in dicts:
        n += 1
        for key, value in d.items():
            value = float(value)
            if key not in out:
                out[key] = value
            elif key.endswith("_min"):
                out[key] = min(out[key], value)
            elif key.endswith("_max"):
                out[key] = max(out[key], value)
            else:
                out[key] += value
    if mean and n:
        out = {k: v if k.endswith(("_min", "_max")) else v / n for k, v in out.items()}
    return out
