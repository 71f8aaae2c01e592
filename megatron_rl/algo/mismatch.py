"""Train-inference mismatch correction with the rollout engine's log-probs: TIS and IcePop.

The weight of a token is built from w = pi_old / pi_rollout (old = the trainer's recomputed
log-probs of the sampling policy, rollout = the engine's sampled log-probs):
tis_token: min(w_t, C); tis_seq: min(prod_t w_t, C) for every token of the sequence;
icepop: w_t inside [a, b], 0 outside (the token is masked out of the policy loss).
Weights carry no gradient.
"""

from __future__ import annotations

import math
from typing import get_args

import torch
from torch import Tensor

from megatron_rl.algo.config import MismatchConfig, MismatchMode

MISMATCH_MODES = get_args(MismatchMode)


def mismatch_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     cfg: MismatchConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights [b,T] for the policy loss and named bool events [b,T] (capped / masked)."""
    log_w = torch.where(mask, old_logp.detach() - rollout_logp.detach(), 0.0)
    if cfg.mode == "none":
        return torch.ones_like(log_w), {}
    if cfg.mode == "tis_token":
        capped = log_w > math.log(cfg.tis_cap)
        return torch.exp(log_w.clamp(max=math.log(cfg.tis_cap))), {"tis_capped_frac": capped}
    if cfg.mode == "tis_seq":
        seq_log_w = log_w.sum(-1, keepdim=True)
        capped = (seq_log_w > math.log(cfg.tis_cap)).expand_as(log_w)
        weight = torch.exp(seq_log_w.clamp(max=math.log(cfg.tis_cap))).expand_as(log_w)
        return weight, {"tis_capped_frac": capped}
    if cfg.mode == "icepop":
        w = torch.exp(log_w.clamp(-30.0, 30.0))
        outside = (w < cfg.icepop_low) | (w > cfg.icepop_high)
        return torch.where(outside, torch.zeros_like(w), w), {"masked_frac": outside}
    raise ValueError(f"algo.mismatch.mode: unknown mode {cfg.mode!r}; "
                     f"valid modes are {list(MISMATCH_MODES)}")
