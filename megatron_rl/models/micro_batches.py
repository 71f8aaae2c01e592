"""This rank's micro-batches of a step as model inputs.

:func:`plan_micro_batches` takes this data-parallel rank's share of a :class:`SequenceBatch`
(balanced by tokens), bin-packs it under the token budget and lays each micro-batch out as
right-padded ``input_ids`` plus the positions of its response tokens (:class:`MicroInputs`).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.models.batch import SequenceBatch, pack_micro_batches, shard_for_dp
from megatron_rl.models.parallel import ParallelGroups


@dataclasses.dataclass
class MicroInputs:
    """One micro-batch's model inputs and where its response tokens sit."""

    index: list[int]  # positions in the SequenceBatch
    input_ids: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    pos_s: torch.Tensor  # [N] sequence position whose output predicts a response token
    pos_b: torch.Tensor  # [N] row of that token
    col: torch.Tensor  # [N] column of that token in the [b, T] response layout
    labels: torch.Tensor  # [N] the response token ids
    mask: torch.Tensor  # [b, T]
    width: int  # T
    # A stand-in so that a rank with no response tokens still runs the schedule (and joins the
    # gradient all-reduce): its outputs are ignored and its loss is 0.
    dummy: bool = False


def make_micro_inputs(batch: SequenceBatch, index: list[int], seq_len: int, rows: int, device) -> MicroInputs:
    """Inputs ``[rows, seq_len]`` (right-padded; rows beyond ``index`` are padding) and the
    positions of the response tokens."""
    seqs = [batch.sequences[i] for i in index]
    prompts = [batch.prompt_lens[i] for i in index]
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    pos_s, pos_b, col, labels = [], [], [], []
    width = max(1, max(len(s) - p for s, p in zip(seqs, prompts)))
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, (s, p) in enumerate(zip(seqs, prompts)):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        n = len(s) - p
        pos_s.append(torch.arange(p - 1, len(s) - 1))
        pos_b.append(torch.full((n,), r, dtype=torch.long))
        col.append(torch.arange(n))
        labels.append(torch.tensor(s[p:], dtype=torch.long))
        mask[r, :n] = True
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return MicroInputs(index=index, input_ids=ids.to(device),
                  position_ids=torch.arange(seq_len).expand(rows, seq_len).to(device),
                  pos_s=cat(pos_s), pos_b=cat(pos_b), col=cat(col), labels=cat(labels),
                  mask=mask.to(device), width=width)


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
    packed = pack_micro_batches(lengths, mine, token_budget, multiple_of=g.pp if g.vpp > 1 else 1)
    pad_to = g.tp if g.sequence_parallel else 1  # sequence parallel splits the sequence
    shapes = [(-(-max(lengths[i] for i in idx) // pad_to) * pad_to, len(idx)) for idx in packed]
    if g.vpp > 1:
        # The interleaved schedule hangs with variable shapes (seen with megatron-core 0.16.1
        # on gloo): one padded shape for every micro-batch of the step.
        common = (max(s for s, _ in shapes), max(r for _, r in shapes))
        shapes = [common] * len(packed)
    micro = [make_micro_inputs(batch, idx, seq, rows, g.device)
             for idx, (seq, rows) in zip(packed, shapes)]
    for mb in micro:
        mb.dummy = dummy
    return micro
