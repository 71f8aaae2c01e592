"""Per-token policy losses, registered by name (``AlgoConfig.policy_loss``).

Each takes the micro-batch's :class:`PolicyTokens` and the config and returns the per-token loss
[b,T] plus named per-token values [b,T]: bool events (e.g. clipped), which :func:`policy_objective`
reports as fractions of the mini-batch's valid tokens, and float values (e.g. a weight), reported as
their token mean (``actor/<name>``). The per-token values are aggregated by ``algo.loss_agg`` afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.algo.registry import register_policy_loss


@dataclass(frozen=True)
class PolicyTokens:
    """One micro-batch's per-token inputs [b,T]; every tensor is 0 at padding (``~mask``)."""

    logp: Tensor  # log pi_theta(y_t), with gradient
    old_logp: Tensor  # log pi_old(y_t) (the recomputed proximal policy, or logp detached), no grad
    log_ratio: Tensor  # log(pi_theta / pi_old), clamped to [-20, 20] against overflow
    advantages: Tensor  # per token (a response's advantage repeated, or token-level)
    mask: Tensor  # bool, valid response tokens
    rollout_logp: Tensor | None = None  # log pi_behav(y_t): the engine that sampled the token


def _ppo_surrogate(ratio: Tensor, advantages: Tensor,
                   cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual-clipped at -c A for A < 0."""
    clip = cfg.clip
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


@register_policy_loss("ppo_clip")
def ppo_clip_loss(t: PolicyTokens, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with clip-higher (eps_low, eps_high) and optional dual clip c.

    loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual clip, for A < 0 the loss is
    further capped at -c A (so a huge ratio on a negative token cannot dominate).
    """
    return _ppo_surrogate(torch.exp(t.log_ratio), t.advantages, cfg)


@register_policy_loss("reinforce")
def reinforce_loss(t: PolicyTokens, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Unclipped importance-weighted policy gradient: -A r (on-policy: the REINFORCE loss)."""
    return -t.advantages * torch.exp(t.log_ratio), {}


@register_policy_loss("gspo")
def gspo_loss(t: PolicyTokens, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, clipped like PPO's.

    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log r_t). Each token carries
    s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)): its value is s_i, and its gradient
    s_i * grad log pi_theta(y_t) (the paper's GSPO-token form; with one advantage per sequence and
    seq-mean-token-mean aggregation it is the paper's sequence objective). The loss is the PPO
    surrogate of s_it (clip range algo.clip), without dual clip.
    """
    m = t.mask.to(t.log_ratio.dtype)
    seq_log_ratio = (t.log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = t.logp - t.logp.detach() + seq_log_ratio.detach()[:, None]
    loss, events = _ppo_surrogate(torch.exp(log_s), t.advantages, cfg)
    return loss, {**events, "seq_ratio": torch.exp(seq_log_ratio.detach())[:, None].expand_as(loss)}


@register_policy_loss("cispo")
def cispo_loss(t: PolicyTokens, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(y_t).

    The clipped ratio is a weight without gradient, so every token keeps its policy gradient
    (PPO's clip zeroes the gradient of clipped tokens); the events count the clipped weights.
    """
    ratio = torch.exp(t.log_ratio.detach())
    clip = cfg.clip
    weight = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    events = {"clipfrac_low": ratio < 1.0 - clip.eps_low, "clipfrac_high": ratio > 1.0 + clip.eps_high}
    return -weight * t.advantages * t.logp, events


@register_policy_loss("decoupled_ppo")
def decoupled_ppo_loss(t: PolicyTokens, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO (Fu et al. 2025): w_t * PPO-clip(pi_theta / pi_prox), where pi_prox is
    the old policy (recomputed before several optimizer steps; before a single one, the training
    forward's own detached log-probs) and w_t = pi_prox(y_t) / pi_behav(y_t) weighs each token by
    how far the weights that sampled it (the engine's log-probs, possibly a stale version) are from pi_prox;
    above algo.decoupled.cap the weight is truncated to the cap or the token masked (over_cap).
    Fresh samples (pi_behav = pi_prox) have w = 1: the loss is ppo_clip's, exactly.
    """
    if t.rollout_logp is None:
        raise ValueError("rollout_logp: policy_loss 'decoupled_ppo' weighs each token by "
                         "pi_prox / pi_behav, so the rollout engine's log-probs must be passed")
    d = cfg.decoupled
    log_w = torch.where(t.mask, t.old_logp.detach() - t.rollout_logp.detach(), 0.0).clamp(-30.0, 30.0)
    over = log_w > math.log(d.cap)
    if d.over_cap == "truncate":
        weight = torch.exp(log_w.clamp(max=math.log(d.cap)))
    else:
        weight = torch.where(over, torch.zeros_like(log_w), torch.exp(log_w))
    loss, events = _ppo_surrogate(torch.exp(t.log_ratio), t.advantages, cfg)
    return loss * weight.to(loss.dtype), {**events, "decoupled_over_cap": over,
                                          "decoupled_weight": weight.detach()}

