"""Context parallelism (CP): one sequence split over the ranks of a CP group.

Layout (Megatron's, so that its rotary embedding and Transformer Engine's attention agree with
it): a sequence padded to a multiple of 2·CP is cut into 2·CP equal chunks and CP rank ``r`` holds
chunks ``r`` and ``2·CP - 1 - r`` (in that order). With causal attention the early chunks are cheap
and the late ones dear; pairing them balances the work. Megatron's ``get_batch_on_this_cp_rank``
does the split (:func:`split_for_cp`), and its ``RotaryEmbedding`` hands each rank the rotary
angles of exactly those positions, so the model needs nothing else to place its tokens.

:func:`context_parallel_attention` is causal attention over the whole sequence for the local
queries, for the CPU (on GPUs, Transformer Engine's attention does CP). It all-gathers K and V over
the CP group (as slime does) and, per local query chunk ``c``, runs two blocks through torch's flash
CPU kernel: the chunks before ``c`` (no mask) and chunk ``c`` itself (causal), merged exactly with
their log-sum-exps. Memory stays linear in the sequence: no score matrix, no mask. Backward
gathers K/V again (only this rank's K/V and queries are kept for it), runs the kernel's backward
per block with the merged output and log-sum-exp (which is exact: the blocks' probabilities are
normalised by the full row), and reduce-scatters the K/V gradients back to their owners.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunks_of_rank(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two (of ``2 * cp_size``) chunks CP rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """What a sequence length must be a multiple of: 2·CP chunks, each rank's part split over TP
    when sequence parallel is on."""
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def split_for_cp(tensors: dict[str, torch.Tensor], cp_group) -> dict[str, torch.Tensor]:
    """This rank's part of ``[b, S, ...]`` tensors (S a multiple of 2·CP): Megatron's
    ``get_batch_on_this_cp_rank``. Identity when the group is None or has one rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cp_group is None or cp_group.size() == 1:
        return dict(tensors)
    seq = {t.shape[1] for t in tensors.values()}
    if len(seq) != 1 or next(iter(seq)) % (2 * cp_group.size()):
        raise ValueError(f"split_for_cp: sequence lengths {sorted(seq)} must be one length, a "
                         f"multiple of 2 * CP = {2 * cp_group.size()}")
    return get_batch_on_this_cp_rank(dict(tensors), cp_group=cp_group)


# ------------------------------------------------------------------------------------------------
# Attention over the CP group (CPU)


def _flash(q, k, v, causal: bool, scale: float):
    # torch's flash CPU kernel, the one scaled_dot_product_attention runs on the CPU; called
    # directly because the merge needs its log-sum-exp (differentiable through _CPAttention).
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _gather_natural(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """All ranks' ``[b, h, 2C, d]`` parts -> the whole sequence ``[b, h, 2·CP·C, d]`` in order."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    c = x.shape[-2] // 2
    pieces = [None] * (2 * cp)
    for r, part in enumerate(parts):
        for half, chunk in enumerate(chunks_of_rank(cp, r)):
            pieces[chunk] = part[..., half * c:(half + 1) * c, :]
    return torch.cat(pieces, dim=-2)


def _scatter_natural(full: torch.Tensor, group, cp: int, rank: int) -> torch.Tensor:
    """Inverse of :func:`_gather_natural` for gradients: sum over ranks, keep this rank's part."""
    c = full.shape[-2] // (2 * cp)
    per_rank = [torch.cat([full[..., k * c:(k + 1) * c, :] for k in chunks_of_rank(cp, r)],
                          dim=-2).contiguous() for r in range(cp)]
    out = torch.empty_like(per_rank[rank])
    dist.reduce_scatter(out, per_rank, group=group)
    return out


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // x.shape[1]
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _blocks(chunk: int, c: int):
    """(key range, causal) blocks a query chunk attends to."""
    own = ((chunk * c, (chunk + 1) * c), True)
    return [((0, chunk * c), False), own] if chunk > 0 else [own]


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp, rank = group.size(), group.rank()
        heads, c = q.shape[1], q.shape[-2] // 2
        kf = _expand(_gather_natural(k, group, cp), heads)
        vf = _expand(_gather_natural(v, group, cp), heads)
        outs, lses = [], []
        for half, chunk in enumerate(chunks_of_rank(cp, rank)):
            qc = q[..., half * c:(half + 1) * c, :]
            out = lse = None
            for (lo, hi), causal in _blocks(chunk, c):
                o, s = _flash(qc, kf[..., lo:hi, :], vf[..., lo:hi, :], causal, scale)
                o, s = o.float(), s.float()
                if out is None:
                    out, lse = o, s
                else:
                    new = torch.logaddexp(lse, s)
                    out = (out * (lse - new).exp()[..., None] + o * (s - new).exp()[..., None])
                    lse = new
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, dim=-2).to(q.dtype)
        lse = torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = group.size(), group.rank()
        heads, groups, c = q.shape[1], k.shape[1], q.shape[-2] // 2
        kf = _expand(_gather_natural(k, group, cp), heads)
        vf = _expand(_gather_natural(v, group, cp), heads)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
        for half, chunk in enumerate(chunks_of_rank(cp, rank)):
            sl = slice(half * c, (half + 1) * c)
            args = (dout[..., sl, :], q[..., sl, :].contiguous())
            o_c, lse_c = out[..., sl, :].contiguous(), lse[..., sl].contiguous()
            for (lo, hi), causal in _blocks(chunk, c):
                gq, gk, gv = _flash_backward(*args, kf[..., lo:hi, :], vf[..., lo:hi, :], o_c,
                                             lse_c, causal, scale)
                dq[..., sl, :] += gq
                dkf[..., lo:hi, :] += gk
                dvf[..., lo:hi, :] += gv
        if heads != groups:  # sum the expanded query heads back onto their key/value group
            b, _, s, d = dkf.shape
            dkf = dkf.view(b, groups, heads // groups, s, d).sum(2)
            dvf = dvf.view(b, groups, heads // groups, s, d).sum(2)
        dk = _scatter_natural(dkf, group, cp, rank)
        dv = _scatter_natural(dvf, group, cp, rank)
        return dq, dk, dv, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                               scale: float) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole CP-split sequence.

    ``q [b, heads, 2C, d]``, ``k`` / ``v [b, groups, 2C, d]``: this rank's two chunks (see the
    module doc); returns ``[b, heads, 2C, d]``. Collective over ``group`` (forward and backward).
    CPU only: on GPUs Transformer Engine's attention does context parallelism.
    """
    if q.device.type != "cpu":
        raise RuntimeError("context_parallel_attention runs on the CPU; on GPUs use the "
                           "Transformer Engine layer spec (policy.layer_spec=te), whose attention "
                           "does context parallelism")
    if q.shape[-2] % 2 or k.shape[-2] != q.shape[-2]:
        raise ValueError(f"context_parallel_attention: local sequence {q.shape[-2]} (queries) / "
                         f"{k.shape[-2]} (keys) must be two equal chunks")
    return _CPAttention.apply(q, k, v, group, float(scale))
