"""This rank's micro-batches of a step as model inputs.

:func:`plan_micro_batches` takes this data-parallel rank's share of a :class:`SequenceBatch`
(balanced by tokens), bin-packs it under the token budget and lays each micro-batch out as
right-padded ``input_ids`` plus the positions of its response tokens (:class:`MicroInputs`).

With context parallelism the padded length is a multiple of 2·CP, every CP rank gets its two
chunks of each row (``context_parallel.split_for_cp``) and only the response tokens whose
predicting position it holds; the token budget is per rank (a micro-batch holds up to CP x the
budget before the split).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.models.batch import SequenceBatch, pack_micro_batches, shard_for_dp
from megatron_rl.models.context_parallel import pad_multiple, split_for_cp
from megatron_rl.models.parallel import ParallelGroups


@dataclasses.dataclass
class MicroInputs:
    """One micro-batch's model inputs and where its response tokens sit."""

    index: list[int]  # positions in the SequenceBatch
    input_ids: torch.Tensor  # [b, S / CP] (this CP rank's chunks)
    position_ids: torch.Tensor  # [b, S / CP] their positions in the sequence
    # The response tokens this rank computes (all of them without CP):
    pos_s: torch.Tensor  # [N] local position whose output predicts a response token
    pos_b: torch.Tensor  # [N] row of that token
    col: torch.Tensor  # [N] column of that token in the [b, T] response layout
    labels: torch.Tensor  # [N] the response token ids
    mask: torch.Tensor  # [b, T] every trained response token of the rows (on every CP rank)
    width: int  # T
    seq_len: int  # S, the padded length before the CP split
    padding_mask: torch.Tensor  # [b, S / CP] True where input_ids is padding (this CP rank's part)
    # A stand-in so that a rank with no response tokens still runs the schedule (and joins the
    # gradient all-reduce): its outputs are ignored and its loss is 0.
    dummy: bool = False


def make_micro_inputs(batch: SequenceBatch, index: list[int], seq_len: int, rows: int, device,
                      cp_group=None) -> MicroInputs:
    """Inputs ``[rows, seq_len]`` (right-padded; rows beyond ``index`` are padding), this CP
    rank's part of them (all without ``cp_group``), and the positions of its response tokens."""
    seqs = [batch.sequences[i] for i in index]
    prompts = [batch.prompt_lens[i] for i in index]
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    padding = torch.ones(rows, seq_len, dtype=torch.bool)
    pos_s, pos_b, col, labels = [], [], [], []
    width = max(1, max(len(s) - p for s, p in zip(seqs, prompts)))
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, (s, p) in enumerate(zip(seqs, prompts)):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        padding[r, : len(s)] = False
        n = len(s) - p
        pos_s.append(torch.arange(p - 1, len(s) - 1))
        pos_b.append(torch.full((n,), r, dtype=torch.long))
        col.append(torch.arange(n))
        labels.append(torch.tensor(s[p:], dtype=torch.long))
        mask[r, :n] = batch.trained(index[r])  # a tool's observation tokens are not trained on
    pos_s, pos_b, col, labels = (torch.cat(xs) for xs in (pos_s, pos_b, col, labels))
    local = split_for_cp({"input_ids": ids, "padding_mask": padding,
                          "position_ids": torch.arange(seq_len).expand(rows, seq_len)}, cp_group)
    held = local["position_ids"][0]  # the sequence positions this rank holds, in local order
    where = torch.full((seq_len,), -1, dtype=torch.long)
    where[held] = torch.arange(held.numel())
    mine = where[pos_s] >= 0
    pos_s, pos_b, col, labels = where[pos_s[mine]], pos_b[mine], col[mine], labels[mine]
    return MicroInputs(index=index, input_ids=local["input_ids"].contiguous().to(device),
                       position_ids=local["position_ids"].contiguous().to(device),
                       pos_s=pos_s.to(device), pos_b=pos_b.to(device), col=col.to(device),
                       labels=labels.to(device), mask=mask.to(device), width=width,
                       seq_len=seq_len,
                       padding_mask=local["padding_mask"].contiguous().to(device))


def plan_micro_batches(batch: SequenceBatch, groups: ParallelGroups, token_budget: int
                       ) -> list[MicroInputs]:
    """This rank's micro-batches of ``batch`` (a rank with no response tokens gets one dummy)."""
    g = groups
    lengths = [len(s) for s in batch.sequences]
    # Sequences without response tokens contribute nothing: never sent through the model.
    useful = [i for i, n in enumerate(batch.response_lens) if n > 0]
    shard = shard_for_dp([lengths[i] for i in useful], g.dp)[g.dp_rank]
    mine = [useful[k] for k in shard]
    dummy = not mine
    if dummy:
        mine = [min(range(len(lengths)), key=lambda i: lengths[i])]
    # The budget is per rank: CP ranks share each micro-batch's tokens.
    packed = pack_micro_batches(lengths, mine, token_budget * g.cp,
                                multiple_of=g.pp if g.vpp > 1 else 1)
    # 2·CP chunks, each rank's part split over TP by sequence parallelism
    pad_to = pad_multiple(g.cp, g.tp, g.sequence_parallel)
    shapes = [(-(-max(lengths[i] for i in idx) // pad_to) * pad_to, len(idx)) for idx in packed]
    if g.vpp > 1:
        # The interleaved schedule hangs with variable shapes (seen with megatron-core 0.16.1
        # on gloo): one padded shape for every micro-batch of the step.
        common = (max(s for s, _ in shapes), max(r for _, r in shapes))
        shapes = [common] * len(packed)
    cp_group = g.cp_group if g.cp > 1 else None
    micro = [make_micro_inputs(batch, idx, seq, rows, g.device, cp_group)
             for idx, (seq, rows) in zip(packed, shapes)]
    for mb in micro:
        mb.dummy = dummy
    return micro
