"""Reward shapers, registered by name (``algo.shaping.shapers``): pure functions of the verifier's
rewards and the responses' lengths and groups, applied in order before the advantages.

"overlong": DAPO's soft overlong punishment; "length_penalty": Kimi k1.5's group length reward;
"passk": each response scored as the best of its subgroup of k (pass@k training's reward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.algo.groups import check_group_inputs, describe, group_index, group_min_max
from megatron_rl.algo.registry import REWARD_SHAPERS, register_reward_shaper


@dataclass(frozen=True)
class ShapingInputs:
    """What a shaper may read besides the rewards (all [B])."""

    index: Tensor  # long, contiguous group index in [0, num_groups)
    num_groups: int
    lengths: Tensor  # float64, response tokens
    correct: Tensor  # bool, the verifier's reward >= correct_reward (before any shaping)
    max_response_len: int  # the stage's


@register_reward_shaper("overlong")
def overlong_penalty(rewards: Tensor, s: ShapingInputs, cfg: AlgoConfig) -> tuple[Tensor, dict]:
    """DAPO (Yu et al. 2025) soft overlong punishment: with L_max the stage's length and L_cache
    = overlong_buffer, a response of L tokens gets min(0, (L_max - L_cache - L) / L_cache) *
    overlong_penalty added: nothing up to L_max - L_cache, then linearly down to -overlong_penalty
    at L_max."""
    sh = cfg.shaping
    if not 0 < sh.overlong_buffer < s.max_response_len:
        raise ValueError(f"algo.shaping.overlong_buffer: must be in [1, {s.max_response_len - 1}] "
                         f"for a stage of max_response_len {s.max_response_len}, got {sh.overlong_buffer}")
    expected = s.max_response_len - sh.overlong_buffer
    penalty = ((expected - s.lengths) / sh.overlong_buffer).clamp(max=0.0) * sh.overlong_penalty
    return rewards + penalty, {"shaping/overlong_penalty_mean": penalty.mean().item(),
                               "shaping/overlong_frac": (penalty < 0).double().mean().item()}


@register_reward_shaper("length_penalty")
def length_penalty(rewards: Tensor, s: ShapingInputs, cfg: AlgoConfig) -> tuple[Tensor, dict]:
    """Kimi k1.5 (2025) length reward, per group: lambda = 0.5 - (L - min L) / (max L - min L)
    (0 when every length is equal); a correct response gets lambda, a wrong one min(0, lambda);
    the shaped reward adds length_coef times it."""
    lo, hi = group_min_max(s.lengths, s.index, s.num_groups)
    span = (hi - lo)[s.index]
    lam = torch.where(span > 0, 0.5 - (s.lengths - lo[s.index]) / span.clamp(min=1e-12), 0.0)
    bonus = torch.where(s.correct, lam, lam.clamp(max=0.0)) * cfg.shaping.length_coef
    return rewards + bonus, {"shaping/length_reward_mean": bonus.mean().item()}


def position_in_group(index: Tensor) -> Tensor:
    """Each response's 0-based position among its group's members, in batch order."""
    pos = torch.empty_like(index)
    seen: dict[int, int] = {}
    for i, gid in enumerate(index.tolist()):
        pos[i] = seen.get(gid, 0)
        seen[gid] = int(pos[i]) + 1
    return pos


@register_reward_shaper("passk")
def passk_reward(rewards: Tensor, s: ShapingInputs, cfg: AlgoConfig) -> tuple[Tensor, dict]:
    """Pass@k training's reward (Chen et al. 2025, full sampling): a group's responses, in order,
    form subgroups of k = algo.passk.k (a last shorter one when k does not divide the group); every
    response's reward becomes its subgroup's maximum, so a subgroup with one solution rewards all
    of its members."""
    k = cfg.passk.k
    sub = s.index * (int(s.lengths.numel()) + 1) + position_in_group(s.index) // k
    sub_index, num_sub = group_index(sub)
    _, best = group_min_max(rewards, sub_index, num_sub)
    shaped = best[sub_index]
    return shaped, {"shaping/passk_reward_mean": shaped.mean().item()}


def shape_rewards(rewards: Tensor, group_ids: Tensor, lengths: Tensor, cfg: AlgoConfig, *,
                  max_response_len: int) -> tuple[Tensor, dict[str, float]]:
    """The rewards after every shaper of ``algo.shaping.shapers``, in order (dtype of ``rewards``),
    and the shapers' metrics; the rewards unchanged when none is named."""
    check_group_inputs(rewards, group_ids)
    if not isinstance(lengths, Tensor) or lengths.shape != rewards.shape:
        raise ValueError(f"lengths: expected shape {tuple(rewards.shape)}, got {describe(lengths)}")
    if not cfg.shaping.shapers:
        return rewards, {}
    r = rewards.detach().to(torch.float64)
    index, num_groups = group_index(group_ids)
    s = ShapingInputs(index=index, num_groups=num_groups, lengths=lengths.to(torch.float64),
                      correct=r >= cfg.correct_reward, max_response_len=max_response_len)
    metrics: dict[str, float] = {}
    for name in cfg.shaping.shapers:
        r, m = REWARD_SHAPERS[name](r, s, cfg)
        metrics.update(m)
    metrics["shaping/reward_mean"] = r.mean().item()
    return r.to(rewards.dtype), metrics
