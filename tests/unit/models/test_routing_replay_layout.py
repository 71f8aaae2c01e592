"""Routing replay's layout: the rows a router sees in a micro-batch, built from per-sequence routes,
in the padded and the packed layout.

Reference: the router's input as Megatron forms it, simulated on token codes (``1000 * sequence +
position``): the micro-batch's model input (padded: one right-padded row per sequence and a padding
row; packed: the sequences back to back in one row, each padded to a multiple of 2·CP, the row to a
multiple of 2·CP·TP with sequence parallelism), CP rank r keeping chunks r and 2·CP-1-r of 2·CP of
every row (padded) or of every sequence's segment (packed, Transformer Engine's THD split), this TP
rank's slice of that under sequence parallelism, then ``[s, b]`` flattened (row ``s * b + j``).
Every row must carry its token's routes (padding: distinct valid experts), and recording then
placing the rows of every CP x TP rank gives the routes back.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_rl.models.packing import packed_layout, padded_layout
from megatron_rl.models.routing_replay import filler, micro_batch_routes, place_recorded, router_tokens

E, K, L = 8, 2, 3


def _routes(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * L)]).view(n, L, K).to(torch.int16)
            for n in lengths]


def _split(row: torch.Tensor, lo: int, hi: int, cp: int, r: int) -> torch.Tensor:
    c = (hi - lo) // (2 * cp)
    return torch.cat([row[..., lo + r * c:lo + (r + 1) * c], row[..., lo + (2 * cp - 1 - r) * c:lo + (2 * cp - r) * c]], -1)


def _model_input(lengths, index, packed, cp, tp, sp, rows):
    """Token codes ``[b, S]`` (-1 at padding) and the segments CP splits (independent of the code under test)."""
    mult = 2 * cp if cp > 1 else 1
    if packed:
        segs, at = [], 0
        for i in index:
            n = -(-lengths[i] // mult) * mult
            segs.append((at, at + n))
            at += n
        total = -(-at // (mult * (tp if sp else 1))) * (mult * (tp if sp else 1))
        if total > at:
            segs.append((at, total))
        codes = torch.full((1, total), -1, dtype=torch.long)
        for (lo, _), i in zip(segs, index):
            codes[0, lo:lo + lengths[i]] = 1000 * i + torch.arange(lengths[i])
        return codes, segs
    pad = 2 * cp * (tp if sp else 1)
    seq_len = -(-max(lengths[i] for i in index) // pad) * pad
    codes = torch.full((rows, seq_len), -1, dtype=torch.long)
    for j, i in enumerate(index):
        codes[j, :lengths[i]] = 1000 * i + torch.arange(lengths[i])
    return codes, [(0, seq_len)]


def _router_view(codes, segs, cp, cp_rank, tp, tp_rank, sp) -> torch.Tensor:
    """The token codes in a router's row order."""
    local = torch.cat([_split(codes, lo, hi, cp, cp_rank) for lo, hi in segs], -1) if cp > 1 else codes
    if sp:
        w = local.shape[1] // tp
        local = local[:, tp_rank * w:(tp_rank + 1) * w]
    return local.t().reshape(-1)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cp,tp,sp", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True), (2, 2, False)])
def test_routing_replay_micro_batch_rows_are_megatrons_token_order(cp, tp, sp, packed):
    lengths = [11, 7, 16]
    routes = _routes(lengths)
    index = [2, 0, 1]
    rows = 1 if packed else 4  # padded: a padding row too (the interleaved schedule's fixed shape)
    codes, segs = _model_input(lengths, index, packed, cp, tp, sp, rows)
    mine = [lengths[i] for i in index]
    if packed:
        layout = packed_layout(mine, 2 * cp if cp > 1 else 1, (2 * cp if cp > 1 else 1) * (tp if sp else 1))
    else:
        layout = padded_layout(mine, 2 * cp * (tp if sp else 1), rows=rows)
    assert (layout.rows, layout.seq_len) == tuple(codes.shape)
    starts = [0, 11, 18]
    flat = torch.zeros(sum(lengths), L, K, dtype=torch.uint8)
    for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
        k, p = router_tokens(layout, cp, cp_rank, tp, tp_rank, sp)
        got = micro_batch_routes(routes, index, k, p, E)
        view = _router_view(codes, segs, cp, cp_rank, tp, tp_rank, sp)
        assert got.shape == (view.numel(), L, K) and got.dtype == torch.long
        for r, code in enumerate(view.tolist()):
            if code >= 0:
                assert torch.equal(got[r], routes[code // 1000][code % 1000].long()), (cp_rank, tp_rank, r, code)
            else:  # padding: valid, distinct experts
                assert got[r].min() >= 0 and got[r].max() < E and all(len(set(x.tolist())) == K for x in got[r])
        if sp or tp_rank == 0:  # each (position, layer) from one rank
            place_recorded(got[:, [2, 0]], flat, starts, index, k, p, [2, 0])
            place_recorded(got[:, [1]], flat, starts, index, k, p, [1])
    assert all(torch.equal(flat[starts[i]:starts[i] + n].to(torch.int16), routes[i]) for i, n in enumerate(lengths))


def test_routing_replay_filler_rows_are_distinct_and_spread():
    f = filler(12, 2, 3, 8)
    assert f.shape == (12, 2, 3)
    assert all(len(set(row.tolist())) == 3 for row in f[:, 0])
    counts = torch.bincount(f[:, 0].reshape(-1), minlength=8)
    assert counts.max() - counts.min() <= 1
