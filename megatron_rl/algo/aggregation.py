"""Loss aggregation over a mini-batch split into micro-batches and data-parallel ranks.

Every mode divides by denominators of the WHOLE mini-batch (``token_denominator`` valid tokens,
``seq_denominator`` sequences, across all micro-batches and ranks), so the per-micro-batch values
SUM to the mini-batch loss whatever the split.
"""

from __future__ import annotations

from typing import get_args

from torch import Tensor

from megatron_rl.algo.config import LossAgg

LOSS_AGG_MODES = get_args(LossAgg)


def aggregate(values: Tensor, mask: Tensor, mode: str, *, token_denominator: float,
              seq_denominator: float, max_response_len: int | None = None) -> Tensor:
    """This micro-batch's share of the mini-batch aggregate of per-token ``values`` [b,T].

    token-mean: sum of valid values / token_denominator (DAPO / Skywork-OR1);
    seq-mean-token-mean: sum over sequences of (mean over its valid tokens) / seq_denominator;
    seq-mean-token-sum-norm: sum over sequences of (sum over its tokens / max_response_len) /
    seq_denominator (Dr.GRPO). Rows without a valid token contribute 0.
    """
    masked = values.where(mask, values.new_zeros(()))
    if mode == "token-mean":
        return masked.sum() / token_denominator
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / seq_denominator
    if mode == "seq-mean-token-sum-norm":
        if max_response_len is None or max_response_len < 1:
            raise ValueError(f"max_response_len: loss_agg 'seq-mean-token-sum-norm' needs a "
                             f"positive max_response_len, got {max_response_len!r}")
        return (masked.sum(-1) / max_response_len).sum() / seq_denominator
    raise ValueError(f"algo.loss_agg: unknown mode {mode!r}; valid modes are {list(LOSS_AGG_MODES)}")
