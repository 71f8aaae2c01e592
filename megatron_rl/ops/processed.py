"""Log-probs of the distribution the rollout engine actually sampled from ("processed" log-probs).

vLLM (``logprobs_mode="processed_logprobs"``, v1 sampler, vllm 0.32 ``apply_top_k_top_p_pytorch``)
returns, for a sampled token, ``log_softmax`` of the fp32 logits after, in this order:

1. temperature: ``z = logits / T``;
2. top-k: every logit strictly below the k-th largest is set to ``-inf`` (ties with it stay);
3. top-p: sort ascending, softmax, cumulative sum; every token whose cumulative mass (itself and
   all smaller ones) is ``<= 1 - p`` is set to ``-inf``; the largest token always stays. Equivalently
   a token stays iff the mass of the tokens sorted above it is ``< p``.

:func:`processed_logprobs` reproduces that for the trainer, so the importance ratio compares the
same distribution on both sides (train-inference consistency). It is the unfused
path: one chunk of tokens holds its full-vocabulary logits at a time (gathered over the vocab-parallel
group when the weight is split), and each chunk is recomputed in the backward pass
(activation checkpointing), so only one chunk's logits are alive at any moment.

A label outside the kept set (possible only when trainer and engine logits differ right at the
top-k / top-p boundary) is put back into the set, so its log-prob stays finite.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary shards along the last dim; backward keeps this rank's slice (the
    computation after the gather is replicated on every rank, so each holds the full gradient)."""

    @staticmethod
    def forward(ctx, shard, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.slice = (rank * shard.shape[-1], (rank + 1) * shard.shape[-1])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        lo, hi = ctx.slice
        return grad[..., lo:hi].contiguous(), None


class _ReduceGradOverGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (replicated input, split use)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def top_k_top_p_mask(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Boolean ``[N, V]`` mask of the tokens vLLM keeps for fp32 logits ``z`` (already / T)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    n_voc = z.shape[-1]
    if top_k is not None and 0 < top_k < n_voc:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None and top_p < 1.0:
        masked = z.masked_fill(~keep, float("-inf"))
        z_sort, idx = masked.sort(dim=-1, descending=False)
        cum = z_sort.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False
        keep &= ~torch.zeros_like(keep).scatter_(-1, idx, drop_sorted)
    return keep


def _chunk_logprobs(hidden, weight, labels, valid, inv_temp, top_k, top_p, group):
    logits = hidden @ weight.t()
    if group is not None:
        logits = _GatherVocab.apply(logits, group)
    z = logits.float() * inv_temp
    with torch.no_grad():
        keep = top_k_top_p_mask(z, top_k, top_p)
        keep.scatter_(-1, labels.clamp(min=0)[:, None], True)
    logp_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    logp = logp_all.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
    return torch.where(valid, logp, 0.0)


def processed_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                       temperature: float = 1.0, top_k: int | None = None,
                       top_p: float | None = None, tp_group=None, ignore_index: int = -100,
                       chunk_tokens: int = 1024) -> torch.Tensor:
    """Per-token log-prob of ``labels`` under vLLM's processed sampling distribution.

    Args:
        hidden: ``[..., H]`` last hidden states; weight: ``[V_local, H]`` output-layer weight
            (this rank's vocabulary shard under ``tp_group``); labels: ``[...]`` global ids.
        temperature: as sampled; top_k: ``None``/``<= 0``/``>= V`` disables it (vLLM's -1 / 0);
        top_p: ``None`` or ``1.0`` disables it.
        chunk_tokens: tokens whose full-vocabulary logits are held at once.

    Returns:
        fp32 ``logp`` shaped like ``labels`` (0 at ``ignore_index``), differentiable with respect to
        ``hidden`` and ``weight``; the mask itself carries no gradient.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    n_voc = weight.shape[0] * world
    lab = labels.reshape(-1).long()
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= n_voc))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"labels[{i}] = {int(lab[i])} outside the vocabulary [0, {n_voc})")
    h = hidden.reshape(-1, hidden.shape[-1])
    if tp_group is not None:
        h = _ReduceGradOverGroup.apply(h, tp_group)
    k = top_k if top_k is not None and 0 < top_k < n_voc else None
    p = top_p if top_p is not None and top_p < 1.0 else None
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    out = []
    for n0 in range(0, h.shape[0], chunk_tokens):
        sl = slice(n0, n0 + chunk_tokens)
        args = (h[sl], weight, lab[sl], valid[sl], 1.0 / temperature, k, p, tp_group)
        out.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad
                   else _chunk_logprobs(*args))
    logp = torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)
    return logp.view(labels.shape)
