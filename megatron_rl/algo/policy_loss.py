"""Per-token policy losses, registered by name (``AlgoConfig.policy_loss``).

Each takes the per-token log-ratio log(pi / pi_old) [b,T], the per-token advantages [b,T] and the
config, and returns the per-token loss [b,T] plus named bool events [b,T] that
:func:`policy_objective` reports as fractions of the mini-batch's valid tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.algo.registry import register_policy_loss


@register_policy_loss("ppo_clip")
def ppo_clip_loss(log_ratio: Tensor, advantages: Tensor,
                  cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with clip-higher (eps_low, eps_high) and optional dual clip c.

    loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual clip, for A < 0 the loss is
    further capped at -c A (so a huge ratio on a negative token cannot dominate).
    """
    clip = cfg.clip
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    loss = torch.maximum(unclipped, clipped)
    events = {
        "clipfrac_low": (advantages < 0) & (ratio < 1.0 - clip.eps_low),
        "clipfrac_high": (advantages > 0) & (ratio > 1.0 + clip.eps_high),
    }
    if clip.dual_clip_c is not None:
        cap = -advantages * clip.dual_clip_c
        negative = advantages < 0
        events["clipfrac_dual"] = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, events


@register_policy_loss("reinforce")
def reinforce_loss(log_ratio: Tensor, advantages: Tensor,
                   cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Unclipped importance-weighted policy gradient: -A r (on-policy: the REINFORCE loss)."""
    return -advantages * torch.exp(log_ratio), {}
