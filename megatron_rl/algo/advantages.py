"""Outcome advantages per response: GRPO (group mean / std) and Dr.GRPO (group mean only).

Semantics follow verl's ``compute_grpo_outcome_advantage`` where they overlap: (r - mean) /
(unbiased std + eps), eps 1e-6. One deliberate difference: a group with fewer than two responses
in its statistics gets advantage 0 (verl passes a lone response's raw reward through), since
without a group there is no baseline. Truncated responses follow ``cfg.truncation_mask``
(Skywork-OR1): "none"; "before" (left out of the statistics, advantage 0); "after" (kept in the
statistics, advantage then set to 0).
"""

from __future__ import annotations

import math
from typing import get_args

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig, TruncationMask
from megatron_rl.algo.groups import check_group_inputs, group_index, group_mean_std
from megatron_rl.algo.registry import ADV_ESTIMATORS, register_adv_estimator

TRUNCATION_MASKS = get_args(TruncationMask)


def _group_centered(rewards: Tensor, index: Tensor, in_stats: Tensor, num_groups: int,
                    divide_by_std: bool, eps: float) -> Tensor:
    # A lone member equals its group mean: advantage 0. Responses outside the statistics
    # (truncated, mask "before") are zeroed by compute_advantages.
    _, mean, std = group_mean_std(rewards, index, in_stats, num_groups)
    adv = rewards - mean[index]
    return adv / (std[index] + eps) if divide_by_std else adv


@register_adv_estimator("grpo")
def grpo_advantages(rewards: Tensor, index: Tensor, in_stats: Tensor, num_groups: int,
                    cfg: AlgoConfig) -> Tensor:
    """(r - group mean) / (group unbiased std + adv_eps); mean only when not norm_adv_by_std."""
    return _group_centered(rewards, index, in_stats, num_groups, cfg.norm_adv_by_std, cfg.adv_eps)


@register_adv_estimator("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, index: Tensor, in_stats: Tensor, num_groups: int,
                       cfg: AlgoConfig) -> Tensor:
    """Dr.GRPO: r - group mean, never divided by the std (whatever norm_adv_by_std says)."""
    return _group_centered(rewards, index, in_stats, num_groups, False, cfg.adv_eps)


def grpo_advantages_reference(rewards: list[float], group_ids: list[int], in_stats: list[bool],
                              *, norm_by_std: bool, eps: float) -> list[float]:
    """Readable loop version of the GRPO / Dr.GRPO advantage (plain Python floats)."""
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    out = [0.0] * len(rewards)
    for rows in members.values():
        stats = [rewards[i] for i in rows if in_stats[i]]
        if len(stats) < 2:
            continue  # no baseline: advantage 0
        mean = sum(stats) / len(stats)
        std = math.sqrt(sum((x - mean) ** 2 for x in stats) / (len(stats) - 1))
        for i in rows:
            out[i] = (rewards[i] - mean) / (std + eps) if norm_by_std else rewards[i] - mean
    return out


def compute_advantages(rewards: Tensor, group_ids: Tensor, truncated: Tensor,
                       cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """Per-response advantages [B] (dtype of ``rewards``) and the metrics that explain them.

    ``group_ids`` [B] integer (same id = same prompt), ``truncated`` [B] bool (hit max length).
    """
    check_group_inputs(rewards, group_ids, truncated=truncated)
    if cfg.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algo.adv_estimator: {ADV_ESTIMATORS.unknown_message(cfg.adv_estimator)}")
    if cfg.truncation_mask not in TRUNCATION_MASKS:
        raise ValueError(f"algo.truncation_mask: unknown strategy {cfg.truncation_mask!r}; valid "
                         f"strategies are {list(TRUNCATION_MASKS)}")
    estimator = ADV_ESTIMATORS[cfg.adv_estimator]
    r = rewards.detach().to(torch.float64)
    index, num_groups = group_index(group_ids)
    in_stats = ~truncated if cfg.truncation_mask == "before" else torch.ones_like(truncated)
    adv = estimator(r, index, in_stats, num_groups, cfg)
    if cfg.truncation_mask != "none":
        adv = torch.where(truncated, torch.zeros_like(adv), adv)

    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, in_stats.double())
    metrics = {
        "adv/mean": adv.mean().item(),
        "adv/abs_mean": adv.abs().mean().item(),
        "adv/min": adv.min().item(),
        "adv/max": adv.max().item(),
        "adv/zero_frac": (adv == 0).double().mean().item(),
        "adv/groups": float(num_groups),
        "adv/groups_without_baseline": (count < 2).sum().item() * 1.0,
        "adv/truncation_zeroed": (truncated.sum().item() if cfg.truncation_mask != "none"
                                  else 0) * 1.0,
        "reward/mean": r.mean().item(),
        "reward/truncated_frac": truncated.double().mean().item(),
    }
    if (~truncated).any():
        metrics["reward/mean_non_truncated"] = r[~truncated].mean().item()
    return adv.to(rewards.dtype), metrics
