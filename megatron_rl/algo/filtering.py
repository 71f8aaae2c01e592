"""Group filtering: drop groups whose rewards carry no signal (zero variance).

A group has zero variance when all its rewards are equal: all-correct, all-wrong, or the same
fractional reward (fractional rewards break all-0 / all-1 filters). Single-response
groups have zero variance too. The counts are reported whether or not filtering is on. With
on-policy distillation nothing is dropped: a group of equal rewards still carries the teacher's
signal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.algo.groups import check_group_inputs, group_index, group_min_max


def drops_zero_variance(cfg: AlgoConfig) -> bool:
    """Whether groups of equal rewards are dropped: with filtering on, unless distillation is on
    (``algo.distill``: the teacher's per-token signal is in every group, all-wrong ones included)."""
    return cfg.filter_zero_variance_groups and not cfg.distill.enabled


def filter_groups(rewards: Tensor, group_ids: Tensor,
                  cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """keep [B] bool (False for responses of zero-variance groups when filtering is on), metrics."""
    check_group_inputs(rewards, group_ids)
    r = rewards.detach().to(torch.float64)
    index, num_groups = group_index(group_ids)
    lo, hi = group_min_max(r, index, num_groups)
    zero_var = lo == hi
    all_correct = zero_var & (lo >= cfg.correct_reward)
    all_wrong = zero_var & (hi <= cfg.wrong_reward)
    drop = zero_var if drops_zero_variance(cfg) else torch.zeros_like(zero_var)
    keep = ~drop[index]
    return keep, _metrics(num_groups, int(zero_var.sum()), int(all_correct.sum()),
                          int(all_wrong.sum()), int((~drop).sum()), int(keep.sum()), len(r))


def _metrics(groups: int, zero_var: int, all_correct: int, all_wrong: int, kept_groups: int,
             kept: int, total: int) -> dict[str, float]:
    return {
        "filter/groups": float(groups),
        "filter/zero_variance": float(zero_var),
        "filter/all_correct": float(all_correct),
        "filter/all_wrong": float(all_wrong),
        "filter/uniform_other": float(zero_var - all_correct - all_wrong),
        "filter/kept_groups": float(kept_groups),
        "filter/kept_responses": float(kept),
        "filter/kept_frac": kept / total,
    }


def filter_groups_reference(rewards: list[float], group_ids: list[int],
                            cfg: AlgoConfig) -> tuple[list[bool], dict[str, float]]:
    """Readable loop version of :func:`filter_groups` (plain Python values)."""
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    keep = [True] * len(rewards)
    zero_var = all_correct = all_wrong = kept_groups = 0
    for rows in members.values():
        values = [rewards[i] for i in rows]
        if len(set(values)) == 1:
            zero_var += 1
            all_correct += values[0] >= cfg.correct_reward
            all_wrong += values[0] <= cfg.wrong_reward
            if drops_zero_variance(cfg):
                for i in rows:
                    keep[i] = False
                continue
        kept_groups += 1
    return keep, _metrics(len(members), zero_var, all_correct, all_wrong, kept_groups, sum(keep),
                          len(rewards))
