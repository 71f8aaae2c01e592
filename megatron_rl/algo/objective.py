"""The policy objective of one micro-batch: policy loss, mismatch correction, entropy and KL terms.

Called once per micro-batch. ``token_denominator`` / ``seq_denominator`` count the valid tokens /
sequences of the WHOLE mini-batch (all micro-batches, all data-parallel ranks), so the returned
losses SUM to the mini-batch loss whatever the split. Metrics: keys ending in ``_min`` / ``_max``
reduce with min / max; every other value is this micro-batch's share, to be summed.

loss = agg(w * m * policy_loss) - alpha * agg(entropy) + kl.coef * agg(kl)
(w: the mismatch correction's weight; m: the token mask, 1 on trained tokens.) With on-policy
distillation the advantage of each token mixes in the teacher's signal first (algo.distill).
SFT is this objective with advantage 1 and old_logp = logp.detach() (its gradient is the NLL's).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rl.algo.aggregation import aggregate
from megatron_rl.algo.config import AlgoConfig
from megatron_rl.algo.distill import distill_advantages
from megatron_rl.algo.entropy import sampled_entropy_surrogate
from megatron_rl.algo.groups import describe
from megatron_rl.algo.kl import kl_estimate
from megatron_rl.algo.mismatch import mismatch_weights
from megatron_rl.algo.policy_loss import PolicyTokens
from megatron_rl.algo.registry import POLICY_LOSSES

# Bound on |log pi - log pi_old| before exponentiating (an overflow guard, as verl does).
MAX_LOG_RATIO = 20.0


def policy_objective(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                     cfg: AlgoConfig, *, entropy: Tensor | None = None, alpha: float = 0.0,
                     rollout_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                     teacher_logp: Tensor | None = None, token_mask: Tensor | None = None,
                     token_denominator: float, seq_denominator: float,
                     max_response_len: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch loss (a scalar with grad) and its metrics.

    logp [b,T] (with grad), old_logp [b,T], advantages [b] or [b,T], mask [b,T] bool (valid
    response tokens). entropy [b,T]: full-vocabulary token entropy (with grad), needed when the
    entropy term is on with estimator "full". rollout_logp [b,T]: the engine's log-probs, needed
    for mismatch correction (and the losses that weigh tokens by it). ref_logp [b,T]: needed for
    the KL loss. teacher_logp [b,T]: the teacher's, needed with algo.distill. token_mask [b,T] bool:
    the tokens the policy loss trains (algo.token_mask; None: all).
    """
    _check_inputs(logp, old_logp, advantages, mask, cfg, entropy=entropy, alpha=alpha,
                  rollout_logp=rollout_logp, ref_logp=ref_logp, teacher_logp=teacher_logp,
                  token_mask=token_mask,
                  token_denominator=token_denominator, seq_denominator=seq_denominator)
    policy_loss = POLICY_LOSSES[cfg.policy_loss]
    zero = logp.new_zeros(())

    def agg(values: Tensor) -> Tensor:
        return aggregate(values, mask, cfg.loss_agg, token_denominator=token_denominator,
                         seq_denominator=seq_denominator, max_response_len=max_response_len)

    def token_share(values: Tensor) -> float:
        return (values.detach().where(mask, zero).sum() / token_denominator).item()

    # Padding positions are replaced by zeros first, so no inf / nan there reaches a gradient.
    log_ratio = torch.where(mask, logp - old_logp.detach(), zero).clamp(-MAX_LOG_RATIO,
                                                                          MAX_LOG_RATIO)
    adv = advantages.detach().to(logp.dtype)
    adv = torch.where(mask, adv[:, None] if adv.dim() == 1 else adv, zero)
    metrics: dict[str, float] = {}
    if cfg.distill.enabled:
        adv, reverse_kl = distill_advantages(adv, old_logp, teacher_logp, mask, cfg.distill)
        metrics["distill/reverse_kl"] = token_share(reverse_kl)
        metrics["distill/advantage_mean"] = token_share(adv)
    tokens = PolicyTokens(
        logp=torch.where(mask, logp, zero), old_logp=torch.where(mask, old_logp.detach(), zero),
        log_ratio=log_ratio, advantages=adv, mask=mask,
        rollout_logp=None if rollout_logp is None else torch.where(mask, rollout_logp.detach(), zero))
    token_loss, events = policy_loss(tokens, cfg)
    if token_mask is not None:
        token_loss = torch.where(token_mask, token_loss, torch.zeros_like(token_loss))
        metrics["actor/trained_token_frac"] = (token_mask & mask).sum().item() / token_denominator

    if cfg.mismatch.mode != "none":
        weight, mismatch_events = mismatch_weights(old_logp, rollout_logp, mask, cfg.mismatch)
        token_loss = token_loss * weight.to(token_loss.dtype)
        events = {**events, **mismatch_events}
        metrics["actor/tis_weight_mean"] = token_share(weight)
        metrics["actor/tis_weight_min"] = weight[mask].min().item()
        metrics["actor/tis_weight_max"] = weight[mask].max().item()
    if rollout_logp is not None:
        metrics["actor/rollout_logp_absdiff"] = token_share((old_logp - rollout_logp).abs())

    pg_loss = agg(token_loss)
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.item()
    for name, event in events.items():
        metrics[f"actor/{name}"] = ((event & mask).sum().item() / token_denominator
                                    if event.dtype == torch.bool else token_share(event))
    ratio = torch.exp(log_ratio.detach())
    metrics["actor/ratio_mean"] = token_share(ratio)
    metrics["actor/ratio_min"] = ratio[mask].min().item()
    metrics["actor/ratio_max"] = ratio[mask].max().item()

    if cfg.entropy.estimator == "sampled":
        entropy_term = sampled_entropy_surrogate(torch.where(mask, logp, zero), log_ratio)
        entropy_value = -torch.where(mask, logp, zero)
    else:
        entropy_term = entropy_value = None if entropy is None else torch.where(mask, entropy,
                                                                               zero)
    if entropy_value is not None and (cfg.entropy.mode != "off" or entropy is not None):
        metrics["actor/entropy"] = token_share(entropy_value)
    if alpha != 0.0:
        entropy_loss = agg(entropy_term)
        loss = loss - alpha * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.item()

    if cfg.kl.enabled and not cfg.kl.as_reward:
        kl = kl_estimate(torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero),
                         cfg.kl.estimator)
        kl_loss = agg(kl)
        loss = loss + cfg.kl.coef * kl_loss
        metrics["actor/kl"] = token_share(kl)
        metrics["actor/kl_loss"] = kl_loss.item()
    metrics["actor/loss"] = loss.item()
    return loss, metrics


def _check_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  cfg: AlgoConfig, *, entropy, alpha, rollout_logp, ref_logp, teacher_logp,
                  token_mask, token_denominator, seq_denominator) -> None:
    """Raise ValueError naming the argument unless the inputs fit together."""
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"logp: expected a [b, T] tensor, got {describe(logp)}")
    shape = tuple(logp.shape)
    for name, value in (("old_logp", old_logp), ("mask", mask), ("entropy", entropy),
                        ("rollout_logp", rollout_logp), ("ref_logp", ref_logp),
                        ("teacher_logp", teacher_logp), ("token_mask", token_mask)):
        if value is not None and (not isinstance(value, Tensor) or tuple(value.shape) != shape):
            raise ValueError(f"{name}: expected shape {shape} like logp, got {describe(value)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor, got dtype {mask.dtype}")
    if token_mask is not None and token_mask.dtype != torch.bool:
        raise ValueError(f"token_mask: expected a bool tensor, got dtype {token_mask.dtype}")
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(f"advantages: expected shape {shape[:1]} or {shape}, "
                         f"got {describe(advantages)}")
    valid = int(mask.sum())
    if valid == 0:
        raise ValueError("mask: no valid token in this micro-batch (empty mask)")
    if not math.isfinite(token_denominator) or token_denominator < valid:
        raise ValueError(f"token_denominator: must count the valid tokens of the whole mini-batch "
                         f"(>= {valid} in this micro-batch alone), got {token_denominator!r}")
    rows = int(mask.any(-1).sum())
    if not math.isfinite(seq_denominator) or seq_denominator < rows:
        raise ValueError(f"seq_denominator: must count the sequences of the whole mini-batch "
                         f"(>= {rows} in this micro-batch alone), got {seq_denominator!r}")
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"algo.policy_loss: {POLICY_LOSSES.unknown_message(cfg.policy_loss)}")
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha: must be a finite number >= 0, got {alpha!r}")
    if alpha != 0.0 and cfg.entropy.mode == "off":
        raise ValueError(f"alpha: is {alpha} but algo.entropy.mode is 'off'")
    if cfg.entropy.estimator not in ("full", "sampled"):
        raise ValueError(f"algo.entropy.estimator: unknown estimator {cfg.entropy.estimator!r}; "
                         f"valid estimators are ['full', 'sampled']")
    if cfg.entropy.mode != "off" and cfg.entropy.estimator == "full" and entropy is None:
        raise ValueError("entropy: algo.entropy.mode is on with estimator 'full', so the "
                         "full-vocabulary token entropy must be passed")
    if cfg.mismatch.mode != "none" and rollout_logp is None:
        raise ValueError(f"rollout_logp: algo.mismatch.mode is {cfg.mismatch.mode!r}, so the "
                         f"rollout engine's log-probs must be passed")
    if cfg.distill.enabled and teacher_logp is None:
        raise ValueError("teacher_logp: algo.distill.coef is > 0, so the teacher's log-probs of the "
                         "sampled tokens must be passed")
    if cfg.kl.enabled and not cfg.kl.as_reward and ref_logp is None:
        raise ValueError("ref_logp: algo.kl is enabled as a loss, so the reference policy's "
                         "log-probs must be passed")
