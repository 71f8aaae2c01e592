"""Online softmax statistics and their vocab-parallel combination.

For one token with (temperature-scaled) logits ``z`` over some slice of the vocabulary, the
partial statistics are three fp32 numbers:

- ``m``: the maximum of ``z`` over the slice,
- ``s``: ``sum(exp(z - m))``,
- ``t``: ``sum(exp(z - m) * (z - m))``.

Slices merge exactly (the online log-sum-exp trick), whether they are vocabulary chunks on one rank
or vocabulary shards on different tensor-parallel ranks. From the merged statistics:

- ``lse = m + log(s)`` (the log partition function),
- ``E_p[z] = m + t / s``,
- ``entropy = lse - E_p[z] = log(s) - t / s``.

Keeping ``t`` relative to the running maximum means nothing large is ever subtracted from
something large, so the entropy keeps its precision in fp32 even when logits are big.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class SoftmaxStats(NamedTuple):
    """Per-token partial statistics, each ``[N]`` fp32 (``t`` may be None when entropy is off)."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor | None


def merge_into(acc: SoftmaxStats, new: SoftmaxStats) -> None:
    """Merge ``new`` into ``acc`` in place (both cover disjoint vocabulary slices)."""
    m = torch.maximum(acc.m, new.m)
    a_scale = torch.exp(acc.m - m)
    n_scale = torch.exp(new.m - m)
    if acc.t is not None:
        # t relative to the new max: e^{m_old-m} * (t_old + (m_old - m) * s_old)
        acc.t.copy_(a_scale * (acc.t + (acc.m - m) * acc.s) + n_scale * (new.t + (new.m - m) * new.s))
    acc.s.copy_(a_scale * acc.s + n_scale * new.s)
    acc.m.copy_(m)


def all_reduce_stats(stats: SoftmaxStats, label_logit: torch.Tensor, group) -> None:
    """Combine per-rank statistics of vocabulary shards over ``group``, in place.

    ``label_logit`` holds the label's logit on the rank that owns the label and 0 elsewhere; after
    the call every rank holds the global statistics and the label logit. Two collectives: a MAX of
    ``m`` and one SUM of the stacked rescaled ``s``, ``t`` and label logits.
    """
    m_global = stats.m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(stats.m - m_global)
    parts = [scale * stats.s, label_logit]
    if stats.t is not None:
        parts.append(scale * (stats.t + (stats.m - m_global) * stats.s))
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    stats.m.copy_(m_global)
    stats.s.copy_(packed[0])
    label_logit.copy_(packed[1])
    if stats.t is not None:
        stats.t.copy_(packed[2])


def log_partition(stats: SoftmaxStats) -> torch.Tensor:
    """``lse = m + log(s)``."""
    return stats.m + torch.log(stats.s)


def entropy(stats: SoftmaxStats) -> torch.Tensor:
    """``H = log(s) - t / s`` (requires ``t``)."""
    return torch.log(stats.s) - stats.t / stats.s


def mean_logit(stats: SoftmaxStats) -> torch.Tensor:
    """``E_p[z] = m + t / s`` (requires ``t``)."""
    return stats.m + stats.t / stats.s
