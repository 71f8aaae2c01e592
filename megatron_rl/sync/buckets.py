"""Flat buckets of HF-named tensors: plan, pack, unpack, checksum.

A bucket is one contiguous ``uint8`` buffer holding whole tensors of one dtype, each starting at a
64-byte aligned offset, plus a small header (:class:`BucketMeta`: names, shapes, dtypes, offsets)
that travels ahead of it. Tensors are grouped per dtype while streaming from the export iterator;
a tensor larger than a bucket travels alone, straight from its own storage (no copy).

The checksum is an order-sensitive integer hash of a tensor's bytes computed with torch ops, so
it gives the same value on CPU and GPU and on both ends of a transfer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator

import torch

ALIGN = 64
_MASK64 = (1 << 64) - 1
_ROW = 1024  # words per row of the checksum's 2-D weighting


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a bucket header")
    return dtype


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat ``uint8`` view (made contiguous first if needed)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8)


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BucketMeta:
    """Header of one bucket: where each tensor lies in the flat buffer."""

    index: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]

    def encode(self) -> bytes:
        rows = [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]
        return json.dumps({"i": self.index, "n": self.nbytes, "t": rows}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "BucketMeta":
        obj = json.loads(raw.decode())
        tensors = tuple(TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in obj["t"])
        return cls(index=obj["i"], nbytes=obj["n"], tensors=tensors)


def layout(items: list[tuple[str, torch.Tensor]], index: int) -> BucketMeta:
    """Offsets of ``items`` packed back to back at aligned offsets."""
    metas, offset = [], 0
    for name, tensor in items:
        metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."),
                                tuple(tensor.shape), offset, tensor.numel() * tensor.element_size()))
        offset += aligned(metas[-1].nbytes)
    return BucketMeta(index=index, nbytes=offset, tensors=tuple(metas))


def group_by_dtype(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream ``(name, tensor)`` into lists that fit one bucket each, one dtype per list.

    One list is open per dtype; it is emitted when the next tensor of its dtype would overflow it.
    A tensor larger than ``bucket_bytes`` is emitted alone at once. Names must be unique.
    """
    open_lists: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    used: dict[torch.dtype, int] = {}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} exported twice in one sync")
        seen.add(name)
        size = aligned(tensor.numel() * tensor.element_size())
        if size > bucket_bytes:
            yield [(name, tensor)]
            continue
        dtype = tensor.dtype
        if used.get(dtype, 0) + size > bucket_bytes:
            yield open_lists.pop(dtype)
            used[dtype] = 0
        open_lists.setdefault(dtype, []).append((name, tensor))
        used[dtype] = used.get(dtype, 0) + size
    yield from (items for items in open_lists.values() if items)


def pack(items: list[tuple[str, torch.Tensor]], index: int,
         buffer: torch.Tensor | None) -> tuple[BucketMeta, torch.Tensor]:
    """Copy ``items`` into ``buffer`` (``uint8``) and return the header and the used slice.

    A single tensor that does not fit ``buffer`` (or ``buffer=None``) is returned as a byte view
    of its own storage, without a copy.
    """
    meta = layout(items, index)
    if buffer is None or meta.nbytes > buffer.numel():
        if len(items) != 1:
            raise ValueError(f"bucket {index} needs {meta.nbytes} bytes, buffer has "
                             f"{0 if buffer is None else buffer.numel()}")
        return meta, as_bytes(items[0][1])
    for (_, tensor), tmeta in zip(items, meta.tensors):
        dst = buffer[tmeta.offset:tmeta.offset + tmeta.nbytes]
        dst.copy_(as_bytes(tensor.detach()), non_blocking=True)
    return meta, buffer[:meta.nbytes]


def unpack(meta: BucketMeta, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of the bucket ``data`` (``uint8``), named as in the header."""
    if data.numel() < meta.nbytes and len(meta.tensors) > 1:
        raise ValueError(f"bucket {meta.index}: {data.numel()} bytes received, header says "
                         f"{meta.nbytes}")
    out = []
    for t in meta.tensors:
        raw = data[t.offset:t.offset + t.nbytes]
        out.append((t.name, raw.view(dtype_from_name(t.dtype)).view(t.shape)))
    return out


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """``1..n`` as int64 on ``device`` (cached; grown as needed)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, _ROW) + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = w
    return w[:n]


def _hash(tensor: torch.Tensor) -> torch.Tensor:
    """The checksum of :func:`checksum` as a 0-d int64 tensor on the tensor's device (no sync)."""
    raw = as_bytes(tensor)
    dev = raw.device
    n_words = raw.numel() // 8
    words = raw[:n_words * 8].view(torch.int64)
    tail = raw[n_words * 8:].to(torch.int64)
    rows = n_words // _ROW
    if rows == 0:  # small tensor: one weighted pass
        total = words.sum() + tail.sum()
        weighted = (words * _weights(n_words, dev)).sum()
    else:
        body, rest = words[:rows * _ROW].view(rows, _ROW), words[rows * _ROW:]
        row_sums = body.sum(dim=1)
        total = row_sums.sum() + rest.sum() + tail.sum()
        weighted = ((row_sums * _weights(rows, dev)).sum()
                    + (body.sum(dim=0) * _weights(_ROW, dev)).sum() * 0x9E3779B1
                    + (rest * _weights(rest.numel(), dev)).sum() * 0x7FEB352D)
    weighted = weighted + (tail * _weights(tail.numel(), dev)).sum() * 0x846CA68B
    return total * 1_000_003 + weighted * 0x100000001B3 + raw.numel()


def checksum(tensor: torch.Tensor) -> int:
    """Order-sensitive 64-bit hash of the tensor's bytes (same value on any device).

    The bytes are read as int64 words; a small tensor mixes the plain sum with the position-
    weighted sum, a larger one lays the words out in rows of 1024 and mixes row sums weighted by
    row index with column sums weighted by column index, so a changed, moved or swapped word
    changes it. Integer sums wrap modulo 2**64 in any order, hence device-independent.
    """
    return int(_hash(tensor)) & _MASK64


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """:func:`checksum` of many tensors with one device sync (what the transports hash)."""
    names, hashes = [], []
    for name, tensor in named:
        names.append(name)
        hashes.append(_hash(tensor))
    if not hashes:
        return {}
    values = torch.stack(hashes).tolist()
    return {n: v & _MASK64 for n, v in zip(names, values)}
