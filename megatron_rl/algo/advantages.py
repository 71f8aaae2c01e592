"""Outcome advantages per response, registered by name (``AlgoConfig.adv_estimator``).

GRPO (group mean / std), Dr.GRPO (group mean only), RLOO (leave-one-out mean), REINFORCE++ (batch
whitening over tokens, with or without the group-mean baseline) and two pass@k-aware estimators.
Semantics follow verl's ``core_algos`` where they overlap: (r - mean) / (unbiased std + eps), eps
1e-6. One deliberate difference: a group with fewer than two responses in its statistics gets
advantage 0 (verl passes a lone response's raw reward through), since without a group there is no
baseline. Truncated responses follow ``cfg.truncation_mask``
(Skywork-OR1): "none"; "before" (left out of the statistics, advantage 0); "after" (kept in the
statistics, advantage then set to 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig, TruncationMask
from megatron_rl.algo.groups import check_group_inputs, describe, group_index, group_mean_std
from megatron_rl.algo.registry import ADV_ESTIMATORS, register_adv_estimator

TRUNCATION_MASKS = get_args(TruncationMask)


@dataclass(frozen=True)
class Groups:
    """How the batch's responses group, for an estimator (all [B])."""

    index: Tensor  # long, contiguous group index in [0, num_groups)
    num_groups: int
    in_stats: Tensor  # bool: the response counts in its group's (and the batch's) statistics
    lengths: Tensor | None = None  # float64 response tokens (batch-whitening estimators need them)


def _group_centered(rewards: Tensor, g: Groups, divide_by_std: bool, eps: float) -> Tensor:
    # A lone member equals its group mean: advantage 0. Responses outside the statistics
    # (truncated, mask "before") are zeroed by compute_advantages.
    _, mean, std = group_mean_std(rewards, g.index, g.in_stats, g.num_groups)
    adv = rewards - mean[g.index]
    return adv / (std[g.index] + eps) if divide_by_std else adv


@register_adv_estimator("grpo")
def grpo_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """(r - group mean) / (group unbiased std + adv_eps); mean only when not norm_adv_by_std."""
    return _group_centered(rewards, g, cfg.norm_adv_by_std, cfg.adv_eps)


@register_adv_estimator("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """Dr.GRPO: r - group mean, never divided by the std (whatever norm_adv_by_std says)."""
    return _group_centered(rewards, g, False, cfg.adv_eps)


@register_adv_estimator("rloo")
def rloo_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean of the OTHER responses of its group,
    = n / (n - 1) * (r_i - group mean) for a group of n >= 2 (0 for a lone response)."""
    count, mean, _ = group_mean_std(rewards, g.index, g.in_stats, g.num_groups)
    n = count[g.index]
    return torch.where(n >= 2, n / (n - 1).clamp(min=1) * (rewards - mean[g.index]), 0.0)


def _token_whitened(values: Tensor, g: Groups, eps: float) -> Tensor:
    """(v - mu) / (sigma + eps) with mu, sigma the mean and unbiased std over the batch's TOKENS (a
    response of L tokens counts L times; its advantage is the same on each of them), over the
    responses in the statistics; 0 when fewer than two tokens are."""
    if g.lengths is None:
        raise ValueError("lengths: this estimator whitens over the batch's tokens, so the "
                         "responses' lengths must be passed")
    w = g.lengths * g.in_stats
    n = w.sum()
    if n < 2:
        return torch.zeros_like(values)
    mu = (w * values).sum() / n
    sigma = ((w * (values - mu).square()).sum() / (n - 1)).sqrt()
    return (values - mu) / (sigma + eps)


@register_adv_estimator("reinforce_plus_plus")
def reinforce_pp_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """REINFORCE++ (Hu 2025), outcome reward, gamma 1: every token's return is the response's reward,
    whitened over all the batch's tokens (no per-prompt baseline)."""
    return _token_whitened(rewards, g, cfg.adv_eps)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """REINFORCE++-baseline: r - group mean, then whitened over all the batch's tokens."""
    return _token_whitened(_group_centered(rewards, g, False, cfg.adv_eps), g, cfg.adv_eps)


@register_adv_estimator("grpo_passk")
def grpo_passk_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """Pass@k as the group's best (Tang et al. 2025, verl's ``grpo_passk``): only the best response of
    a group gets an advantage, r_max - r_second_max, divided by the group's unbiased std + adv_eps
    when norm_adv_by_std (the first of tied best ones; a tie gives 0 anyway)."""
    adv = torch.zeros_like(rewards)
    for gid in range(g.num_groups):
        rows = ((g.index == gid) & g.in_stats).nonzero().flatten()
        if rows.numel() < 2:
            continue
        r = rewards[rows]
        top = torch.topk(r, 2)
        a = top.values[0] - top.values[1]
        if cfg.norm_adv_by_std:
            a = a / (r.std() + cfg.adv_eps)
        adv[rows[top.indices[0]]] = a
    return adv


@register_adv_estimator("passk")
def passk_advantages(rewards: Tensor, g: Groups, cfg: AlgoConfig) -> Tensor:
    """The analytic pass@k advantage (Chen et al. 2025, "Pass@k Training"): the GRPO advantage of
    the reward max(subset) averaged over every k-subset of the group that holds the response.

    A group of N with N_neg wrong (reward < correct_reward): mean R = 1 - C(N_neg, k) / C(N, k),
    sigma = sqrt(R (1 - R)); a correct response gets (1 - R) / sigma, a wrong one
    (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma (adv_eps added to sigma); k is
    min(algo.passk.k, N); a group with sigma 0 (fewer than k wrong, or none right) gets 0.
    """
    correct = rewards >= cfg.correct_reward
    adv = torch.zeros_like(rewards)
    for gid in range(g.num_groups):
        rows = ((g.index == gid) & g.in_stats).nonzero().flatten()
        n = rows.numel()
        if n < 2:
            continue
        k = min(cfg.passk.k, n)
        n_neg = int((~correct[rows]).sum())
        mean = 1.0 - math.comb(n_neg, k) / math.comb(n, k)
        sigma = math.sqrt(mean * (1.0 - mean))
        if sigma == 0.0:
            continue
        neg = 1.0 - mean - (math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg else 0.0)
        values = rewards.new_tensor([neg, 1.0 - mean]) / (sigma + cfg.adv_eps)
        adv[rows] = values[correct[rows].long()]
    return adv


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


def compute_advantages(rewards: Tensor, group_ids: Tensor, truncated: Tensor, cfg: AlgoConfig, *,
                       lengths: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Per-response advantages [B] (dtype of ``rewards``) and the metrics that explain them.

    ``group_ids`` [B] integer (same id = same prompt), ``truncated`` [B] bool (hit max length),
    ``lengths`` [B] response tokens (needed by the estimators that whiten over tokens).
    """
    check_group_inputs(rewards, group_ids, truncated=truncated)
    if lengths is not None and (not isinstance(lengths, Tensor) or lengths.shape != rewards.shape):
        raise ValueError(f"lengths: expected shape {tuple(rewards.shape)}, got {describe(lengths)}")
    if cfg.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algo.adv_estimator: {ADV_ESTIMATORS.unknown_message(cfg.adv_estimator)}")
    if cfg.truncation_mask not in TRUNCATION_MASKS:
        raise ValueError(f"algo.truncation_mask: unknown strategy {cfg.truncation_mask!r}; valid "
                         f"strategies are {list(TRUNCATION_MASKS)}")
    estimator = ADV_ESTIMATORS[cfg.adv_estimator]
    r = rewards.detach().to(torch.float64)
    index, num_groups = group_index(group_ids)
    in_stats = ~truncated if cfg.truncation_mask == "before" else torch.ones_like(truncated)
    adv = estimator(r, Groups(index=index, num_groups=num_groups, in_stats=in_stats,
                              lengths=None if lengths is None else lengths.detach().to(torch.float64)),
                    cfg)
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
