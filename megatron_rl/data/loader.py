"""PromptLoader: fixed-size batches of prompts, epochs rolling over, resumable exactly.

Epoch ``e`` visits the records in the order ``permutation(seed, e)`` (or in file order without
``shuffle``); a batch that crosses an epoch boundary takes the rest of one epoch and the start of
the next. The state is two integers (epoch, position), so a resumed run sees the same batches.
"""

from __future__ import annotations

import random

from megatron_rl.data.dataset import DataError


class PromptLoader:
    def __init__(self, records: list, batch_size: int, seed: int = 0, shuffle: bool = True):
        if not records:
            raise DataError("PromptLoader needs at least one record")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"prompt-loader:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list:
        return [self.records[i] for i in self.take(self.batch_size)]

    def take(self, n: int) -> list[int]:
        """Indices (into ``records``) of the next ``n`` prompts, in the order batches walk them."""
        out: list[int] = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._permutation(self.epoch)
            k = min(n - len(out), len(self._order) - self.pos)
            out.extend(self._order[self.pos: self.pos + k])
            self.pos += k
        return out

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "num_records": len(self.records), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume; refuses a state from another dataset size, seed or shuffle setting."""
        for key, mine in (("num_records", len(self.records)), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataError(f"data loader state has {key}={state[key]!r} but this loader has "
                                 f"{mine!r}: the dataset or its settings changed since the checkpoint")
        if not 0 <= state["pos"] <= len(self.records):
            raise DataError(f"data loader state pos={state['pos']} out of range")
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._order = self._permutation(self.epoch)
