"""Routing replay's layout: the rows a router sees in a micro-batch, built from per-sequence routes.

Reference: the router's input as Megatron forms it, simulated on token codes (``1000 * sequence +
position``): the micro-batch ``[b, S]`` right-padded, CP rank r keeping chunks r and 2·CP-1-r of 2·CP,
this TP rank's slice of that under sequence parallelism, then ``[s, b]`` flattened (row ``s * b + j``).
Every row must carry its token's routes (padding: distinct valid experts), and recording then placing
the rows of every CP x TP rank gives the routes back.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_rl.models.routing_replay import filler, local_positions, micro_batch_routes, place_recorded

E, K, L = 8, 2, 3


def _routes(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * L)]).view(n, L, K).to(torch.int16)
            for n in lengths]


def _router_view(codes: torch.Tensor, cp: int, cp_rank: int, tp: int, tp_rank: int, sp: bool) -> torch.Tensor:
    """The token codes in a router's row order (independent of the code under test)."""
    b, s = codes.shape
    c = s // (2 * cp)
    local = torch.cat([codes[:, cp_rank * c:(cp_rank + 1) * c],
                       codes[:, (2 * cp - 1 - cp_rank) * c:(2 * cp - cp_rank) * c]], 1)
    if sp:
        w = local.shape[1] // tp
        local = local[:, tp_rank * w:(tp_rank + 1) * w]
    return local.t().reshape(-1)


@pytest.mark.parametrize("cp,tp,sp", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True), (2, 2, False)])
def test_routing_replay_micro_batch_rows_are_megatrons_token_order(cp, tp, sp):
    lengths = [11, 7, 16]
    routes = _routes(lengths)
    index, rows = [2, 0, 1], 4  # a padding row too
    seq_len = 16 if cp * (tp if sp else 1) <= 4 else 24
    pad = 2 * cp * (tp if sp else 1)
    seq_len = -(-seq_len // pad) * pad
    codes = torch.full((rows, seq_len), -1, dtype=torch.long)
    for j, i in enumerate(index):
        codes[j, :lengths[i]] = 1000 * i + torch.arange(lengths[i])
    starts = [0, 11, 18]
    flat = torch.zeros(sum(lengths), L, K, dtype=torch.uint8)
    for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
        c = seq_len // (2 * cp)
        held = torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                          torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)])
        positions = local_positions(held.expand(rows, -1), tp, tp_rank, sp)
        got = micro_batch_routes(routes, index, rows, positions, E)
        view = _router_view(codes, cp, cp_rank, tp, tp_rank, sp)
        assert got.shape == (view.numel(), L, K) and got.dtype == torch.long
        for r, code in enumerate(view.tolist()):
            if code >= 0:
                assert torch.equal(got[r], routes[code // 1000][code % 1000].long()), (cp_rank, tp_rank, r, code)
            else:  # padding: valid, distinct experts
                assert got[r].min() >= 0 and got[r].max() < E and all(len(set(x.tolist())) == K for x in got[r])
        if sp or tp_rank == 0:  # each (position, layer) from one rank
            place_recorded(got[:, [2, 0]], flat, starts, lengths, index, rows, positions, [2, 0])
            place_recorded(got[:, [1]], flat, starts, lengths, index, rows, positions, [1])
    assert all(torch.equal(flat[starts[i]:starts[i] + n].to(torch.int16), routes[i]) for i, n in enumerate(lengths))


def test_routing_replay_filler_rows_are_distinct_and_spread():
    f = filler(12, 2, 3, 8)
    assert f.shape == (12, 2, 3)
    assert all(len(set(row.tolist())) == 3 for row in f[:, 0])
    counts = torch.bincount(f[:, 0].reshape(-1), minlength=8)
    assert counts.max() - counts.min() <= 1
