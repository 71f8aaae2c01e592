"""Sequence packing, pure logic: layouts (where every token sits), the CP split of packed rows,
attention within packed sequences against a block-diagonal causal mask (float64), and balanced
micro-batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.models.context_parallel import cp_positions
from megatron_rl.models.packing import (attention_weight, pack_micro_batches,
                                        packed_causal_attention, packed_layout, padded_layout,
                                        sequence_costs, shard_for_dp)


def test_packed_layout_places_every_token_once_and_restarts_positions():
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    lay = packed_layout([len(s) for s in seqs], multiple=4, total_multiple=8)
    # each sequence padded to 4, then a tail segment to a multiple of 8
    assert lay.bounds == [0, 4, 12, 16] and lay.seq_len == 16 and lay.rows == 1
    ids, pos = lay.inputs(seqs)
    for k, seq in enumerate(seqs):
        for p, tok in enumerate(seq):
            s, b = lay.where(k, p)
            assert ids[b, s] == tok and pos[b, s] == p
    assert int((ids != 0).sum()) == sum(len(s) for s in seqs)
    assert pos[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    params = lay.packed_seq_params("cpu")
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 9]  # real tokens (the tail is a whole segment)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16]
    assert params.max_seqlen_q == 8
    # a fixed shape adds a tail segment
    assert packed_layout([3, 5], multiple=1, seq_len=12).bounds == [0, 3, 8, 12]


def test_padded_layout_is_one_row_per_sequence():
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8]]
    lay = padded_layout([3, 5], multiple=4, rows=3)
    assert (lay.rows, lay.seq_len, lay.bounds) == (3, 8, [0, 8])
    ids, _ = lay.inputs(seqs)
    assert ids[1, :5].tolist() == [4, 5, 6, 7, 8] and lay.where(1, 4) == (4, 1)
    assert lay.packed_seq_params("cpu") is None


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_of_one_row_is_megatrons(cp, monkeypatch):
    """One sequence per row: the positions each CP rank holds are Megatron's own split."""
    from megatron.core import utils

    s = 8 * cp
    row = torch.arange(s)[None]
    for rank in range(cp):
        monkeypatch.setattr(utils, "get_pg_size", lambda g: cp)
        monkeypatch.setattr(utils, "get_pg_rank", lambda g, r=rank: r)
        mine = utils.get_batch_on_this_cp_rank({"x": row.clone()}, cp_group=object())["x"][0]
        assert torch.equal(cp_positions([0, s], cp, rank), mine)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_split_of_packed_rows_cuts_each_sequence(cp):
    """Packed: rank r holds chunks r and 2·CP-1-r of every sequence; the ranks together hold
    every position once."""
    lay = packed_layout([5, 1, 13], multiple=2 * cp)
    held = [cp_positions(lay.bounds, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(lay.seq_len))
    for r, mine in enumerate(held):
        expect = []
        for lo, hi in zip(lay.bounds, lay.bounds[1:]):
            c = (hi - lo) // (2 * cp)
            expect += list(range(lo + r * c, lo + (r + 1) * c))
            expect += list(range(lo + (2 * cp - 1 - r) * c, lo + (2 * cp - r) * c))
        assert mine.tolist() == expect


def _masked_reference(q, k, v, bounds, scale):
    t = q.shape[0]
    mask = torch.zeros(t, t, dtype=torch.bool)
    for a, b in zip(bounds, bounds[1:]):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(*(x.permute(1, 0, 2)[None] for x in (q, k, v)),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].permute(1, 0, 2)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_packed_attention_equals_a_block_diagonal_causal_mask(heads, groups):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 7, 30, 2, 64, 65, 9, 7, 3]  # equal lengths batched, lone ones, a length-1 sequence
    bounds = packed_layout(lengths, multiple=1).bounds
    t = bounds[-1]
    q = torch.randn(t, heads, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(t, groups, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(t, groups, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    out = packed_causal_attention(q, k, v, bounds, scale=0.4)
    ref = _masked_reference(q, k, v, bounds, 0.4)
    assert float((out - ref).abs().max()) < 1e-12
    dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) < 1e-12


def _lengths(seed, n):
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(5, 0.8))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [64, 512, 4096])
def test_packed_micro_batches_respect_the_budget_and_balance_cost(seed, budget):
    lengths = _lengths(seed, 60)
    idx = list(range(0, 60, 2)) + [1]
    costs = sequence_costs(lengths, 1e-3)
    batches = pack_micro_batches(lengths, idx, budget, packed=True, costs=costs)
    assert sorted(i for b in batches for i in b) == sorted(idx)
    tokens = [sum(lengths[i] for i in b) for b in batches]
    assert all(t <= budget or len(b) == 1 for t, b in zip(tokens, batches))
    # as few micro-batches as the budget allows, give or take the ones long sequences force
    forced = sum(lengths[i] > budget // 2 for i in idx)
    assert len(batches) <= max(-(-sum(lengths[i] for i in idx) // budget), 1) + forced
    # balanced: no micro-batch costs more than the mean by more than its dearest sequence
    cost = [sum(costs[i] for i in b) for b in batches]
    mean = sum(cost) / len(cost)
    assert all(c <= mean + max(costs[i] for i in b) for c, b in zip(cost, batches))


def test_padded_micro_batches_unchanged():
    lengths = [10, 3, 8, 8, 2]
    assert pack_micro_batches(lengths, [0, 1, 2, 3, 4], 24) == [[0, 2], [3, 1, 4]]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_dp_shards_balance_attention_cost(dp):
    """One long sequence costs more than its tokens: balancing by cost puts fewer tokens beside it."""
    lengths = [4000] + [500] * 14
    w = attention_weight(hidden=1024, ffn_hidden=4096, heads=16, kv_heads=4, head_dim=64, vocab=32000)
    costs = sequence_costs(lengths, w)
    by_cost = shard_for_dp(costs, dp)
    by_tokens = shard_for_dp([float(n) for n in lengths], dp)
    worst = lambda shards: max(sum(costs[i] for i in s) for s in shards)  # noqa: E731
    assert worst(by_cost) <= worst(by_tokens)
    assert sorted(i for s in by_cost for i in s) == list(range(len(lengths)))
    mean = sum(costs) / dp
    assert worst(by_cost) <= mean + max(costs)
