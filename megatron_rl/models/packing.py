"""Sequence packing: where a micro-batch's tokens sit in the model input, and how a step's
sequences are split over data-parallel ranks and micro-batches.

Two layouts of a micro-batch, one interface (:class:`TokenLayout`):

- **padded** (``bshd``): one row per sequence, every row right-padded to the longest (rounded up to
  what CP / SP need). The model computes ``rows x longest`` token positions.
- **packed** (``thd``, ``policy.packed_sequences``): the sequences concatenated in one row, each
  padded only to a multiple of 2·CP (x TP with sequence parallelism), plus a tail segment where the
  schedule needs a fixed shape (the interleaved pipeline) or SP needs a multiple of TP. Megatron gets
  :meth:`TokenLayout.packed_seq_params` (``qkv_format="thd"``, ``cu_seqlens``): its rotary embedding
  restarts at 0 in every sequence, and the attention stays within each sequence — Transformer
  Engine's THD kernels on GPUs; on the CPU :func:`packed_causal_attention` (torch's fused kernel on
  the row's sequences, those of one length batched together: the block-diagonal causal mask is never
  formed, and nothing attends over padding).
  Every padding position belongs to some sequence's segment (after its last token) or to the tail;
  no real token attends to one (causal).

The one map from a token to its place: :meth:`TokenLayout.where` ``(k, p) -> (s, b)``: token ``p``
of the micro-batch's ``k``-th sequence is at position ``s`` of row ``b`` of the model input (before
the CP split; :func:`megatron_rl.models.context_parallel.cp_positions` gives the positions each CP
rank holds, in its local order). Megatron's activations are ``[s, b, h]``, so the token's flat row in
a layer's ``[s * b, h]`` view is ``s * rows + b``.

Balance (:func:`sequence_costs`): a sequence of ``L`` tokens costs ``L + w * L^2`` — its tokens
through the linear layers plus causal attention's quadratic term, ``w`` the ratio of one attention
pair's FLOPs to one token's (:func:`attention_weight`, from the architecture). :func:`shard_for_dp`
spreads sequences over data-parallel ranks by cost (so no rank waits for another's long
sequence), :func:`pack_micro_batches` groups one rank's sequences under the token budget: padded by
length (similar lengths per micro-batch, little padding), packed into the fewest micro-batches the
budget allows with their costs balanced (pipeline stages then wait little for each other).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------------------
# Balance


def attention_weight(hidden: int, ffn_hidden: int, heads: int, kv_heads: int, head_dim: int,
                     vocab: int) -> float:
    """FLOPs of one causal attention pair (q·k and p·v over every head, half the square) relative
    to one token's linear layers (q/k/v/o projections, the gated MLP, the output layer)."""
    per_token = (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
                 + 3 * hidden * ffn_hidden + hidden * vocab)
    per_pair = heads * head_dim  # 2 matmuls x (1/2: causal)
    return per_pair / per_token


def sequence_costs(lengths: list[int], weight: float) -> list[float]:
    """Compute cost of each sequence: ``L + weight * L^2`` (see :func:`attention_weight`)."""
    return [n + weight * n * n for n in lengths]


def shard_for_dp(costs: list[float], dp: int) -> list[list[int]]:
    """Split sequence indices over ``dp`` ranks, balancing their summed cost (token counts, or
    :func:`sequence_costs`): dearest first onto the cheapest rank. Every rank gets at least one
    sequence when there are at least ``dp``; each rank's indices come in that order."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, 0, r) for r in range(dp)]  # (cost, sequences, rank)
    shards: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        cost, count, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (cost + costs[i], count + 1, r))
    return shards


def pack_micro_batches(lengths: list[int], indices: list[int], token_budget: int,
                       multiple_of: int = 1, packed: bool = False,
                       costs: list[float] | None = None) -> list[list[int]]:
    """Group ``indices`` into micro-batches that fit ``token_budget``.

    Padded (``packed`` False): the padded size (count x longest) fits; sequences are taken longest
    first, so each micro-batch holds sequences of similar length. Packed: the summed lengths fit;
    as few micro-batches as the budget allows, each sequence (dearest first by ``costs``, default
    the lengths) onto the cheapest one it fits in, a new one when it fits in none. Either way a
    sequence longer than the budget gets a micro-batch of its own. With ``multiple_of`` > 1 the
    largest micro-batches are split until the count is a multiple of it where the sequences allow
    (the interleaved pipeline schedule wants a multiple of the pipeline size).
    """
    if packed:
        batches = _pack_balanced(lengths, indices, token_budget, costs or [float(n) for n in lengths])
    else:
        order = sorted(indices, key=lambda i: (-lengths[i], i))
        batches = []
        for i in order:
            if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
                batches[-1].append(i)
            else:
                batches.append([i])
    while len(batches) % multiple_of:
        big = max(range(len(batches)), key=lambda k: len(batches[k]))
        if len(batches[big]) < 2:
            break
        half = len(batches[big]) // 2
        batches[big:big + 1] = [batches[big][:half], batches[big][half:]]
    return batches


def _pack_balanced(lengths: list[int], indices: list[int], budget: int, costs: list[float]
                   ) -> list[list[int]]:
    order = sorted(indices, key=lambda i: (-costs[i], -lengths[i], i))
    total = sum(lengths[i] for i in indices)
    bins: list[list[int]] = [[] for _ in range(max(1, math.ceil(total / budget)))]
    tokens = [0] * len(bins)
    cost = [0.0] * len(bins)
    for i in order:
        fits = [k for k in range(len(bins)) if not bins[k] or tokens[k] + lengths[i] <= budget]
        if not fits:
            bins.append([])
            tokens.append(0)
            cost.append(0.0)
            fits = [len(bins) - 1]
        k = min(fits, key=lambda k: (cost[k], tokens[k], k))
        bins[k].append(i)
        tokens[k] += lengths[i]
        cost[k] += costs[i]
    return [b for b in bins if b]


# ------------------------------------------------------------------------------------------------
# Layouts


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class TokenLayout:
    """Where a micro-batch's sequences sit in its ``[rows, seq_len]`` model input (module doc)."""

    packed: bool
    rows: int  # b (1 when packed)
    seq_len: int  # S: positions per row, before the CP split
    lengths: list[int]  # tokens of each sequence, in micro-batch order
    starts: list[int]  # packed: where each sequence starts in the row; padded: 0
    # Packed: segment boundaries of the row (each sequence padded to the layout's multiple, then
    # the tail), i.e. the padded layout's cu_seqlens; padded: [0, seq_len].
    bounds: list[int]

    def where(self, k: int, p: int) -> tuple[int, int]:
        """``(s, b)``: token ``p`` of sequence ``k`` sits at position ``s`` of row ``b``."""
        return (self.starts[k] + p, 0) if self.packed else (p, k)

    def place(self, k: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`where` of many tokens at once: sequences ``k`` and positions ``p`` (index tensors)
        -> ``(s, b)`` index tensors."""
        if self.packed:
            return torch.tensor(self.starts, dtype=torch.long)[k] + p, torch.zeros_like(k)
        return p, k

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the micro-batch, sequence by sequence: ``(k, p)`` index tensors."""
        lens = torch.tensor(self.lengths, dtype=torch.long)
        k = torch.repeat_interleave(torch.arange(len(self.lengths)), lens)
        first = torch.cumsum(lens, 0) - lens
        return k, torch.arange(int(lens.sum())) - first[k]

    def inputs(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``position_ids`` ``[rows, seq_len]`` (0 in padding; positions count
        from 0 in every segment)."""
        ids = torch.zeros(self.rows, self.seq_len, dtype=torch.long)
        s, b = self.place(*self.tokens())
        ids[b, s] = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
        if self.packed:
            pos = torch.cat([torch.arange(b - a) for a, b in zip(self.bounds, self.bounds[1:])])[None]
        else:
            pos = torch.arange(self.seq_len).expand(self.rows, self.seq_len)
        return ids, pos

    def packed_seq_params(self, device):
        """Megatron's ``PackedSeqParams`` of a packed layout (None when padded): ``cu_seqlens``
        of the real tokens and of the padded segments (the tail counted as one sequence)."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        seg = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        real = self.lengths + seg[len(self.lengths):]
        cu = torch.tensor([0, *itertools.accumulate(real)], dtype=torch.int32, device=device)
        cu_padded = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        longest = max(seg)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                               max_seqlen_q=longest, max_seqlen_kv=longest)


def padded_layout(lengths: list[int], multiple: int, seq_len: int | None = None,
                  rows: int | None = None) -> TokenLayout:
    """One row per sequence; ``seq_len`` / ``rows`` larger than needed: a fixed shape."""
    s = max(round_up(max(lengths), multiple), seq_len or 0)
    return TokenLayout(packed=False, rows=max(len(lengths), rows or 0), seq_len=s,
                       lengths=list(lengths), starts=[0] * len(lengths), bounds=[0, s])


def packed_layout(lengths: list[int], multiple: int, total_multiple: int = 1,
                  seq_len: int | None = None) -> TokenLayout:
    """The sequences in one row, each padded to ``multiple``; a tail segment pads the row to a
    multiple of ``total_multiple`` (and to ``seq_len`` when given: a fixed shape)."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + round_up(max(n, 1), multiple))
    total = max(round_up(bounds[-1], total_multiple), seq_len or 0)
    if total > bounds[-1]:
        bounds.append(total)
    return TokenLayout(packed=True, rows=1, seq_len=total, lengths=list(lengths),
                       starts=bounds[:len(lengths)], bounds=bounds)


# ------------------------------------------------------------------------------------------------
# Attention within each packed sequence (CPU)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                            scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each packed sequence: ``q [t, heads, d]``, ``k`` / ``v
    [t, groups, d]``, sequence ``i`` = rows ``bounds[i] .. bounds[i + 1] - 1``; returns
    ``[t, heads, d]``.

    Equal to one attention over the row with a block-diagonal causal mask, without forming it: the
    row is split into its sequences (views), sequences of one length are stacked into a batch and go
    through torch's fused kernel together (a long sequence alone), and the outputs are concatenated
    back in order. No padding, no score matrix: memory and work are those of the sequences' own
    attention; the split / stack / cat pass the gradient back in one copy each.
    """
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    qs, ks, vs = (x.split(lengths) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(lengths)
    for idx in by_len.values():
        # [g, n, h, d] -> [g, h, n, d]
        qb, kb, vb = (torch.stack([xs[i] for i in idx]).transpose(1, 2) for xs in (qs, ks, vs))
        o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout, is_causal=True, scale=scale,
                                           enable_gqa=gqa)
        for i, part in zip(idx, o.transpose(1, 2).unbind(0)):
            outs[i] = part
    return torch.cat(outs)
