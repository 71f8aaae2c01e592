"""Context parallelism (CP): one sequence split over the ranks of a CP group.

Layout (Megatron's, so that its rotary embedding and Transformer Engine's attention agree with
it): a sequence padded to a multiple of 2·CP is cut into 2·CP equal chunks and CP rank ``r`` holds
chunks ``r`` and ``2·CP - 1 - r`` (in that order). With causal attention the early chunks are cheap
and the late ones dear; pairing them balances the work. :func:`cp_positions` gives the positions a
rank holds (the split of Megatron's ``get_batch_on_this_cp_rank``), and Megatron's
``RotaryEmbedding`` hands each rank the rotary angles of exactly those positions, so the model
needs nothing else to place its tokens.
Packed sequences (THD, ``models/packing.py``) are split the same way one sequence at a time
(Transformer Engine's THD layout, which Megatron's THD rotary embedding follows): every sequence of
the packed row is padded to a multiple of 2·CP and rank ``r`` holds chunks ``r`` and
``2·CP - 1 - r`` of each, sequence after sequence (:func:`cp_positions`).

:func:`context_parallel_attention` is causal attention over the whole sequence for the local
queries, for the CPU (on GPUs, Transformer Engine's attention does CP). It all-gathers K and V over
the CP group (as slime does) and, per local query chunk ``c``, runs two blocks through torch's flash
CPU kernel: the chunks before ``c`` (no mask) and chunk ``c`` itself (causal), merged exactly with
their log-sum-exps. Memory stays linear in the sequence: no score matrix, no mask. Backward
gathers K/V again (only this rank's K/V and queries are kept for it), runs the kernel's backward
per block with the merged output and log-sum-exp (which is exact: the blocks' probabilities are
normalised by the full row), and reduce-scatters the K/V gradients back to their owners. Packed
sequences: the same per sequence, after one all-gather of the whole packed K/V.
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


def cp_positions(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of a row that CP rank ``cp_rank`` holds, in its local order: chunks ``r`` and
    ``2·CP - 1 - r`` of each sequence ``[bounds[i], bounds[i + 1])`` (lengths multiples of 2·CP).
    ``bounds = [0, S]``: one sequence per row (Megatron's ``get_batch_on_this_cp_rank``)."""
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        c = (hi - lo) // (2 * cp_size)
        for chunk in chunks_of_rank(cp_size, cp_rank):
            parts.append(torch.arange(lo + chunk * c, lo + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


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


def _gather_natural(x: torch.Tensor, group, cp: int, segments: list[tuple[int, int]]
                    ) -> list[torch.Tensor]:
    """All ranks' ``[b, h, S_loc, d]`` parts -> each segment's whole sequence ``[b, h, 2·CP·C, d]``
    in natural order (one all-gather). A segment ``(lo, hi)`` is one sequence's local rows on every
    rank: its two chunks of ``C = (hi - lo) / 2`` rows (see the module doc)."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = []
    for lo, hi in segments:
        c = (hi - lo) // 2
        pieces = [None] * (2 * cp)
        for r, part in enumerate(parts):
            for half, chunk in enumerate(chunks_of_rank(cp, r)):
                pieces[chunk] = part[..., lo + half * c:lo + (half + 1) * c, :]
        out.append(torch.cat(pieces, dim=-2))
    return out


def _scatter_natural(full: list[torch.Tensor], group, cp: int, rank: int) -> torch.Tensor:
    """Inverse of :func:`_gather_natural` for gradients: sum over ranks, keep this rank's part
    (one reduce-scatter)."""
    per_rank = []
    for r in range(cp):
        pieces = []
        for seq in full:
            c = seq.shape[-2] // (2 * cp)
            pieces += [seq[..., k * c:(k + 1) * c, :] for k in chunks_of_rank(cp, r)]
        per_rank.append(torch.cat(pieces, dim=-2).contiguous())
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


def _local_chunks(segments: list[tuple[int, int]], cp: int, rank: int):
    """(segment number, local row range, chunk of its sequence) of every local query chunk."""
    for n, (lo, hi) in enumerate(segments):
        c = (hi - lo) // 2
        for half, chunk in enumerate(chunks_of_rank(cp, rank)):
            yield n, slice(lo + half * c, lo + (half + 1) * c), chunk, c


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, segments):
        cp, rank = group.size(), group.rank()
        heads = q.shape[1]
        kf = [_expand(t, heads) for t in _gather_natural(k, group, cp, segments)]
        vf = [_expand(t, heads) for t in _gather_natural(v, group, cp, segments)]
        outs, lses = [], []
        for n, rows, chunk, c in _local_chunks(segments, cp, rank):
            qc = q[..., rows, :]
            out = lse = None
            for (lo, hi), causal in _blocks(chunk, c):
                o, s = _flash(qc, kf[n][..., lo:hi, :], vf[n][..., lo:hi, :], causal, scale)
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
        ctx.group, ctx.scale, ctx.segments = group, scale, segments
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, segments = ctx.group, ctx.scale, ctx.segments
        cp, rank = group.size(), group.rank()
        heads, groups = q.shape[1], k.shape[1]
        kf = [_expand(t, heads) for t in _gather_natural(k, group, cp, segments)]
        vf = [_expand(t, heads) for t in _gather_natural(v, group, cp, segments)]
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dkf, dvf = [torch.zeros_like(t) for t in kf], [torch.zeros_like(t) for t in vf]
        for n, rows, chunk, c in _local_chunks(segments, cp, rank):
            args = (dout[..., rows, :], q[..., rows, :].contiguous())
            o_c, lse_c = out[..., rows, :].contiguous(), lse[..., rows].contiguous()
            for (lo, hi), causal in _blocks(chunk, c):
                gq, gk, gv = _flash_backward(*args, kf[n][..., lo:hi, :], vf[n][..., lo:hi, :], o_c,
                                             lse_c, causal, scale)
                dq[..., rows, :] += gq
                dkf[n][..., lo:hi, :] += gk
                dvf[n][..., lo:hi, :] += gv
        if heads != groups:  # sum the expanded query heads back onto their key/value group
            def fold(t):
                b, _, s, d = t.shape
                return t.view(b, groups, heads // groups, s, d).sum(2)
            dkf, dvf = [fold(t) for t in dkf], [fold(t) for t in dvf]
        dk = _scatter_natural(dkf, group, cp, rank)
        dv = _scatter_natural(dvf, group, cp, rank)
        return dq, dk, dv, None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                               scale: float, bounds: list[int] | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole CP-split sequence(s).

    ``q [b, heads, S_loc, d]``, ``k`` / ``v [b, groups, S_loc, d]``: this rank's two chunks of each
    sequence (see the module doc); returns ``[b, heads, S_loc, d]``. ``bounds``: packed sequences
    (``b`` = 1): the sequences' start offsets in the whole packed row and its end (``cu_seqlens``
    of the padded layout, each length a multiple of 2·CP); each sequence is split over the ranks
    on its own and attention stays within it. None: one sequence per row. Collective over
    ``group`` (forward and backward). CPU only: on GPUs Transformer Engine's attention does
    context parallelism.
    """
    if q.device.type != "cpu":
        raise RuntimeError("context_parallel_attention runs on the CPU; on GPUs use the "
                           "Transformer Engine layer spec (policy.layer_spec=te), whose attention "
                           "does context parallelism")
    cp = group.size()
    if bounds is None:
        bounds = [0, q.shape[-2] * cp]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(n % (2 * cp) for n in lengths) or bounds[-1] != q.shape[-2] * cp or \
            k.shape[-2] != q.shape[-2]:
        raise ValueError(f"context_parallel_attention: local sequence {q.shape[-2]} (queries) / "
                         f"{k.shape[-2]} (keys) over CP = {cp} must be two equal chunks of each "
                         f"sequence; sequence lengths {lengths} must be multiples of 2 * CP")
    segments = [(a // cp, b // cp) for a, b in zip(bounds, bounds[1:])]
    return _CPAttention.apply(q, k, v, group, float(scale), segments)
