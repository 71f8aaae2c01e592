"""This rank's micro-batches of a step as model inputs.

:func:`plan_micro_batches` takes this data-parallel rank's share of a :class:`SequenceBatch`
(balanced by cost: tokens and attention's quadratic term, ``packing.shard_for_dp``), groups it
under the token budget (``packing.pack_micro_batches``) and lays each micro-batch out as model
input (:class:`MicroInputs`): right-padded rows, or the sequences packed into one row with
``packed_seq_params`` (``policy.packed_sequences``; ``models/packing.py`` has both layouts and the
one map from a token to its place), plus the positions of its response tokens.

With context parallelism every sequence is padded to a multiple of 2·CP, every CP rank gets its
two chunks of each (``context_parallel.cp_positions``) and only the response tokens whose
predicting position it holds; the token budget is per rank (a micro-batch holds up to CP x the
budget before the split).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.models.batch import LOSS_MASK, SequenceBatch
from megatron_rl.models.context_parallel import cp_positions, pad_multiple
from megatron_rl.models.packing import (TokenLayout, pack_micro_batches, packed_layout, padded_layout,
                                        round_up, sequence_costs, shard_for_dp)
from megatron_rl.models.parallel import ParallelGroups


@dataclasses.dataclass
class MicroInputs:
    """One micro-batch's model inputs and where its response tokens sit."""

    index: list[int]  # positions in the SequenceBatch
    input_ids: torch.Tensor  # [b, S / CP] (this CP rank's chunks); b = 1 when packed
    position_ids: torch.Tensor  # [b, S / CP] their positions in their sequence
    # The response tokens this rank computes (all of them without CP):
    pos_s: torch.Tensor  # [N] local position whose output predicts a response token
    pos_b: torch.Tensor  # [N] model-input row of that position
    row: torch.Tensor  # [N] the token's sequence (row of the [b, T] response layout)
    col: torch.Tensor  # [N] column of that token in the [b, T] response layout
    labels: torch.Tensor  # [N] the response token ids
    mask: torch.Tensor  # [b, T] every trained response token of the rows (on every CP rank)
    width: int  # T
    seq_len: int  # S, the padded length before the CP split
    padding_mask: torch.Tensor  # [b, S / CP] True where input_ids is padding (this CP rank's part)
    layout: TokenLayout | None = None  # where each token of the micro-batch sits (before CP)
    packed_seq_params: object = None  # Megatron's PackedSeqParams when packed, else None
    # A stand-in so that a rank with no response tokens still runs the schedule (and joins the
    # gradient all-reduce): its outputs are ignored and its loss is 0.
    dummy: bool = False


def make_micro_inputs(batch: SequenceBatch, index: list[int], layout: TokenLayout, device,
                      cp_group=None) -> MicroInputs:
    """The micro-batch of ``index`` laid out as ``layout``, this CP rank's part of it (all without
    ``cp_group``), and the positions of its response tokens."""
    seqs = [batch.sequences[i] for i in index]
    prompts = torch.tensor([batch.prompt_lens[i] for i in index], dtype=torch.long)
    ids, positions = layout.inputs(seqs)
    k, p = layout.tokens()
    padding = torch.ones(ids.shape, dtype=torch.bool)  # True where no sequence's token sits
    s_all, b_all = layout.place(k, p)
    padding[b_all, s_all] = False
    # every response token: position t of its sequence predicts token t + 1
    response = p >= prompts[k]
    row, p_resp = k[response], p[response]
    s_tok, b_tok = layout.place(row, p_resp)
    labels = ids[b_tok, s_tok]
    pos_s, pos_b = layout.place(row, p_resp - 1)
    col = p_resp - prompts[row]
    counts = torch.tensor([len(x) for x in seqs], dtype=torch.long) - prompts
    width = max(1, int(counts.max()))
    mask = torch.arange(width)[None, :] < counts[:, None]
    if LOSS_MASK in batch.token_fields:  # a tool's observation tokens are not trained on
        for r, i in enumerate(index):
            mask[r, : int(counts[r])] = batch.trained(i)
    if cp_group is not None and cp_group.size() > 1:
        held = cp_positions(layout.bounds, cp_group.size(), cp_group.rank())  # local order
        ids, positions, padding = ids[:, held], positions[:, held], padding[:, held]
        where = torch.full((layout.seq_len,), -1, dtype=torch.long)
        where[held] = torch.arange(held.numel())
        mine = where[pos_s] >= 0
        pos_s, pos_b, row, col, labels = (where[pos_s[mine]], pos_b[mine], row[mine], col[mine],
                                          labels[mine])
    return MicroInputs(index=index, input_ids=ids.contiguous().to(device),
                       position_ids=positions.contiguous().to(device),
                       pos_s=pos_s.to(device), pos_b=pos_b.to(device), row=row.to(device),
                       col=col.to(device), labels=labels.to(device), mask=mask.to(device),
                       width=width, seq_len=layout.seq_len, layout=layout,
                       padding_mask=padding.contiguous().to(device),
                       packed_seq_params=layout.packed_seq_params(device))


def plan_micro_batches(batch: SequenceBatch, groups: ParallelGroups, token_budget: int,
                       packed: bool = False, attn_weight: float = 0.0) -> list[MicroInputs]:
    """This rank's micro-batches of ``batch`` (a rank with no response tokens gets one dummy);
    ``packed``: the packed layout; ``attn_weight``: attention's quadratic term in the balance
    (``packing.attention_weight``)."""
    g = groups
    # With CP every sequence takes a multiple of 2·CP positions (its CP chunks).
    per_seq = 2 * g.cp if g.cp > 1 else 1
    lengths = [round_up(len(s), per_seq) for s in batch.sequences]
    costs = sequence_costs(lengths, attn_weight)
    # Sequences without response tokens contribute nothing: never sent through the model.
    useful = [i for i, n in enumerate(batch.response_lens) if n > 0]
    shard = shard_for_dp([costs[i] for i in useful], g.dp)[g.dp_rank]
    mine = [useful[k] for k in shard]
    dummy = not mine
    if dummy:
        mine = [min(range(len(lengths)), key=lambda i: lengths[i])]
    # The budget is per rank: CP ranks share each micro-batch's tokens.
    groups_of = pack_micro_batches(lengths, mine, token_budget * g.cp,
                                   multiple_of=g.pp if g.vpp > 1 else 1, packed=packed, costs=costs)
    # A row: 2·CP chunks, each rank's part split over TP by sequence parallelism
    pad_to = pad_multiple(g.cp, g.tp, g.sequence_parallel)
    row_multiple = per_seq * (g.tp if g.sequence_parallel else 1)
    true_lens = [[len(batch.sequences[i]) for i in idx] for idx in groups_of]
    if packed:
        layouts = [packed_layout(n, per_seq, row_multiple) for n in true_lens]
    else:
        layouts = [padded_layout(n, pad_to) for n in true_lens]
    if g.vpp > 1:
        # The interleaved schedule hangs with variable shapes (seen with megatron-core 0.16.1
        # on gloo): one shape for every micro-batch of the step.
        seq_len, rows = max(x.seq_len for x in layouts), max(x.rows for x in layouts)
        layouts = [packed_layout(n, per_seq, row_multiple, seq_len=seq_len) if packed
                   else padded_layout(n, pad_to, seq_len=seq_len, rows=rows) for n in true_lens]
    cp_group = g.cp_group if g.cp > 1 else None
    micro = [make_micro_inputs(batch, idx, layout, g.device, cp_group)
             for idx, layout in zip(groups_of, layouts)]
    for mb in micro:
        mb.dummy = dummy
    return micro
