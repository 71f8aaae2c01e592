"""Grouping of responses by prompt: input checks and per-group statistics (vectorised)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_group_inputs(rewards: Tensor, group_ids: Tensor, **per_response: Tensor | None) -> None:
    """Raise ValueError naming the argument (and row) unless the per-response inputs are well formed.

    ``rewards`` is a finite float vector [B], ``group_ids`` an integer vector [B]; every other
    keyword (e.g. ``truncated``) must be a bool vector [B].
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor, got {describe(rewards)}")
    if rewards.numel() == 0:
        raise ValueError("rewards: empty batch")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards: expected a float tensor, got dtype {rewards.dtype}")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise ValueError(f"rewards: non-finite value {rewards[row].item()} at row {row}")
    batch = rewards.shape[0]
    if not isinstance(group_ids, Tensor) or group_ids.shape != (batch,):
        raise ValueError(f"group_ids: expected shape ({batch},), got {describe(group_ids)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise ValueError(f"group_ids: expected an integer tensor, got dtype {group_ids.dtype}")
    for name, value in per_response.items():
        if not isinstance(value, Tensor) or value.shape != (batch,):
            raise ValueError(f"{name}: expected shape ({batch},), got {describe(value)}")
        if value.dtype != torch.bool:
            raise ValueError(f"{name}: expected a bool tensor, got dtype {value.dtype}")


def describe(value) -> str:
    """A short description of an argument for error messages."""
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to contiguous indices 0..G-1; returns (index [B], G)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1


def group_mean_std(values: Tensor, index: Tensor, include: Tensor, num_groups: int):
    """Per-group count, mean and unbiased std of ``values`` over the members where ``include``.

    Groups with fewer than two included members get std 0 (and mean 0 when empty).
    """
    weight = include.to(values.dtype)
    count = values.new_zeros(num_groups).index_add_(0, index, weight)
    mean = values.new_zeros(num_groups).index_add_(0, index, values * weight) / count.clamp(min=1)
    sq_dev = (values - mean[index]).square() * weight
    var = values.new_zeros(num_groups).index_add_(0, index, sq_dev) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def group_min_max(values: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group minimum and maximum of ``values``."""
    lo = values.new_full((num_groups,), float("inf")).scatter_reduce(0, index, values, "amin")
    hi = values.new_full((num_groups,), float("-inf")).scatter_reduce(0, index, values, "amax")
    return lo, hi
