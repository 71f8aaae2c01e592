"""Batches the policy consumes, and their split over data-parallel ranks and micro-batches.

A :class:`SequenceBatch` is B sequences (prompt + response token ids) with per-response-token and
per-sequence fields; ``models/packing.py`` splits it over data-parallel ranks and micro-batches and
lays the micro-batches out. A loss function sees a :class:`MicroBatch`, padded over RESPONSE
positions only.
"""

from __future__ import annotations

import dataclasses

import torch

# The token field that says which response tokens are trained on: 1 for the model's own, 0 for a
# tool's observation between the turns of a multi-turn trajectory. Absent: every response token.
LOSS_MASK = "loss_mask"


@dataclasses.dataclass
class SequenceBatch:
    """B sequences, each = prompt + response token ids."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    # per sequence, one value per RESPONSE token (len(sequence) - prompt_len values)
    token_fields: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    # one value per sequence, shape [B]
    seq_fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # per sequence, one row per POSITION (prompt and response: len(sequence) rows, any trailing
    # shape), e.g. the MoE routes of routing replay ([len, moe_layers, top_k])
    position_fields: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def __len__(self) -> int:
        return len(self.sequences)

    def select(self, indices) -> SequenceBatch:
        """The sequences at ``indices`` (a list or 1-D tensor), in that order, with their fields."""
        idx = [int(i) for i in indices]
        at = torch.tensor(idx, dtype=torch.long)
        return SequenceBatch(sequences=[self.sequences[i] for i in idx],
                             prompt_lens=[self.prompt_lens[i] for i in idx],
                             token_fields={k: [v[i] for i in idx] for k, v in self.token_fields.items()},
                             seq_fields={k: v[at] for k, v in self.seq_fields.items()},
                             position_fields={k: [v[i] for i in idx] for k, v in self.position_fields.items()})

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    def trained(self, i: int) -> torch.Tensor:
        """Which response tokens of sequence ``i`` are trained on (bool, one per response token)."""
        mask = self.token_fields.get(LOSS_MASK)
        if mask is None:
            return torch.ones(len(self.sequences[i]) - self.prompt_lens[i], dtype=torch.bool)
        return mask[i].bool()

    def check(self) -> None:
        """Raise ValueError naming the field and row of any inconsistency."""
        n = len(self.sequences)
        if len(self.prompt_lens) != n:
            raise ValueError(f"SequenceBatch: {len(self.prompt_lens)} prompt_lens for {n} sequences")
        for i, (seq, p) in enumerate(zip(self.sequences, self.prompt_lens)):
            if not 1 <= p <= len(seq):
                raise ValueError(f"SequenceBatch row {i}: prompt_len {p} must be in [1, "
                                 f"len(sequence)={len(seq)}]")
        lens = self.response_lens
        for key, values in self.token_fields.items():
            if len(values) != n:
                raise ValueError(f"SequenceBatch token_fields[{key!r}]: {len(values)} rows for {n} "
                                 f"sequences")
            for i, v in enumerate(values):
                if tuple(v.shape) != (lens[i],):
                    raise ValueError(f"SequenceBatch token_fields[{key!r}] row {i}: shape "
                                     f"{tuple(v.shape)}, expected ({lens[i]},) (response tokens)")
        for key, values in self.position_fields.items():
            if len(values) != n:
                raise ValueError(f"SequenceBatch position_fields[{key!r}]: {len(values)} rows for {n} "
                                 f"sequences")
            for i, v in enumerate(values):
                if v.dim() == 0 or v.shape[0] != len(self.sequences[i]):
                    raise ValueError(f"SequenceBatch position_fields[{key!r}] row {i}: shape "
                                     f"{tuple(v.shape)}, expected ({len(self.sequences[i])}, ...) (positions)")
        for key, v in self.seq_fields.items():
            if tuple(v.shape) != (n,):
                raise ValueError(f"SequenceBatch seq_fields[{key!r}]: shape {tuple(v.shape)}, "
                                 f"expected ({n},)")


@dataclasses.dataclass
class MicroBatch:
    """What a loss function sees, padded over RESPONSE positions."""

    logp: torch.Tensor  # [b, T] log-prob of each response token at the temperature (grad in training)
    entropy: torch.Tensor | None  # [b, T] full-distribution entropy at the temperature
    mask: torch.Tensor  # [b, T] bool, valid response tokens
    fields: dict[str, torch.Tensor]  # token_fields padded to [b, T] (0 outside mask); seq_fields [b]
    index: torch.Tensor  # [b] positions of these sequences in the SequenceBatch


class PerSequence:
    """Per-sequence values computed from the training forward, gathered onto every rank.

    ``fn(view)`` returns ``{name: tensor [b]}`` for a :class:`MicroBatch` (called without grad, on
    the ranks that hold the loss); ``names`` lists what it returns. After
    ``policy.train_step(batch, ..., per_sequence=ps)``, ``ps.values[name]`` is a ``[B]`` CPU float
    tensor in batch order, NaN for a sequence no micro-batch held (no response tokens).
    """

    def __init__(self, fn, names: tuple[str, ...], n: int):
        self.fn, self.names, self.n = fn, tuple(names), n
        self._flat = torch.zeros(len(self.names) + 1, n, dtype=torch.float32)  # last row: seen
        self.values: dict[str, torch.Tensor] = {}

    def add(self, view: MicroBatch) -> None:
        with torch.no_grad():
            out = self.fn(view)
        index = view.index.cpu()
        for i, name in enumerate(self.names):
            self._flat[i, index] = out[name].detach().float().cpu()
        self._flat[-1, index] = 1.0

    def gather(self, all_reduce=None) -> dict[str, torch.Tensor]:
        """Sum the ranks' disjoint contributions (``all_reduce(tensor)`` in place; None: one rank)."""
        flat = self._flat
        if all_reduce is not None:
            all_reduce(flat)
        seen = flat[-1] > 0
        self.values = {name: torch.where(seen, flat[i], torch.full_like(flat[i], float("nan")))
                       for i, name in enumerate(self.names)}
        return self.values


def pad_token_fields(batch: SequenceBatch, index: list[int], width: int) -> dict[str, torch.Tensor]:
    """The micro-batch's fields: token fields padded to ``[b, width]`` (0 outside the response),
    sequence fields as ``[b]``."""
    out = {}
    for key, values in batch.token_fields.items():
        rows = [values[i] for i in index]
        dtype = rows[0].dtype if rows else torch.float32
        padded = torch.zeros(len(index), width, dtype=dtype)
        for r, v in enumerate(rows):
            padded[r, : v.shape[0]] = v
        out[key] = padded
    idx = torch.tensor(index, dtype=torch.long)
    for key, v in batch.seq_fields.items():
        out[key] = v[idx]
    return out
