"""KL divergence to the reference policy: per-token estimators, as a loss term or reward penalty."""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig, KLEstimator

KL_ESTIMATORS = get_args(KLEstimator)


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token log-probs [b,T].

    With log r = log pi - log ref: k1 = log r; k2 = (log r)^2 / 2; k3_unclamped = exp(-log r) -
    1 + log r (unbiased, non-negative; log r is bounded to [-20, 20] only against overflow);
    low_var_kl = k3_unclamped clamped to [-10, 10] (what verl calls both "low_var_kl" and "k3").
    """
    log_r = logp - ref_logp
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator in ("k3_unclamped", "low_var_kl"):
        log_r = log_r.clamp(-20.0, 20.0)
        k3 = torch.exp(-log_r) - 1.0 + log_r
        return k3.clamp(-10.0, 10.0) if estimator == "low_var_kl" else k3
    raise ValueError(f"algo.kl.estimator: unknown estimator {estimator!r}; "
                     f"valid estimators are {list(KL_ESTIMATORS)}")


def kl_reward_penalty(old_logp: Tensor, ref_logp: Tensor, mask: Tensor,
                      cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """KL as a reward penalty (``cfg.kl.as_reward``): coef * per-sequence sum of token KL, [b].

    The trainer subtracts it from the outcome rewards before :func:`compute_advantages`.
    """
    kl = torch.where(mask, kl_estimate(old_logp.detach(), ref_logp.detach(), cfg.kl.estimator), 0)
    seq_kl = kl.sum(-1)
    penalty = cfg.kl.coef * seq_kl if cfg.kl.enabled and cfg.kl.as_reward else torch.zeros_like(seq_kl)
    tokens = mask.sum().clamp(min=1)
    return penalty, {"kl/seq_mean": seq_kl.mean().item(),
                     "kl/token_mean": (kl.sum() / tokens).item(),
                     "kl/reward_penalty_mean": penalty.mean().item()}
