"""Packed buckets of HF-named tensors: the plan both ends compute, packing, and the bucket checksum.

A bucket is one contiguous ``uint8`` buffer holding whole tensors of one dtype back to back (one
dtype per bucket keeps every tensor's offset a multiple of its element size, so vLLM's
``unpack_tensor`` can view the bytes in place). Tensors are grouped per dtype while streaming from
the export iterator; a tensor larger than a bucket travels alone, straight from its own storage.
The sender and every receiver run the same :func:`group_by_dtype` over the same metadata, so they
cut the stream into the same buckets without any header on the wire.

Checksums, one per bucket (not one per tensor), so that verification stays a small fraction of
the transfer; a transport uses ONE definition on both of its ends:

- :func:`host_digest` (the ``gloo`` transport: buckets in host memory): XXH3-64 of the bucket's bytes,
  read in place through the buffer protocol (no copy), at memory speed (~12 GB/s on one core here;
  the library releases the GIL, so a thread hashes beside other work).
- :func:`hash_tensor` / :func:`checksum` (buckets in device memory): an order-sensitive integer hash
  computed with torch ops on the tensor's own device (no copy of the weights to the host); the same
  value on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import xxhash

_MASK64 = (1 << 64) - 1
_ROW = 1024  # words per row of the checksum's 2-D weighting

Named = tuple[str, torch.Tensor]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat ``uint8`` view (made contiguous first if needed)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def group_by_dtype(named_tensors: Iterable[Named], bucket_bytes: int) -> Iterator[list[Named]]:
    """Stream ``(name, tensor)`` into lists that fit one bucket each, one dtype per list.

    One list is open per dtype; it is emitted when the next tensor of its dtype would overflow it.
    A tensor larger than ``bucket_bytes`` is emitted alone at once. Names must be unique. Works on
    ``meta`` tensors too: a receiver plans from the metadata alone.
    """
    open_lists: dict[torch.dtype, list[Named]] = {}
    used: dict[torch.dtype, int] = {}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} exported twice in one sync")
        seen.add(name)
        size = nbytes(tensor)
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


def meta_tensors(names: Sequence[str], dtype_names: Sequence[str],
                 shapes: Sequence[Sequence[int]]) -> Iterator[Named]:
    """``(name, meta tensor)`` for a transfer's metadata (what a receiver plans with)."""
    for name, dtype, shape in zip(names, dtype_names, shapes, strict=True):
        yield name, torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")


def bucket_nbytes(items: list[Named]) -> int:
    return sum(nbytes(t) for _, t in items)


def pack(items: list[Named], buffer: torch.Tensor | None) -> torch.Tensor:
    """Copy ``items`` back to back into ``buffer`` (``uint8``); returns the used slice.

    A single tensor that does not fit ``buffer`` (or ``buffer=None``) is returned as a byte view of
    its own storage, without a copy.
    """
    size = bucket_nbytes(items)
    if buffer is None or size > buffer.numel():
        if len(items) != 1:
            raise ValueError(f"a bucket of {len(items)} tensors needs {size} bytes, the buffer has "
                             f"{0 if buffer is None else buffer.numel()}")
        return as_bytes(items[0][1].detach())
    offset = 0
    for _, tensor in items:
        n = nbytes(tensor)
        buffer[offset:offset + n].copy_(as_bytes(tensor.detach()), non_blocking=True)
        offset += n
    return buffer[:size]


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """``1..n`` as int64 on ``device`` (cached; grown as needed)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, _ROW) + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = w
    return w[:n]


def hash_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The checksum of :func:`checksum` as a 0-d int64 tensor on the tensor's device (no sync)."""
    raw = as_bytes(tensor)
    dev = raw.device
    n_words = raw.numel() // 8
    words = raw[:n_words * 8].view(torch.int64)
    tail = raw[n_words * 8:].to(torch.int64)
    rows = n_words // _ROW
    if rows == 0:  # small: one weighted pass
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
    return int(hash_tensor(tensor)) & _MASK64


def host_digest(tensor: torch.Tensor) -> int:
    """XXH3-64 of a host tensor's bytes as a signed 64-bit int (what an int64 tensor holds), read in
    place: a contiguous tensor is not copied. Any changed byte, or two words swapped, changes it."""
    raw = as_bytes(tensor)
    if raw.device.type != "cpu":
        raise ValueError(f"host_digest hashes host memory; a {raw.device} tensor needs hash_tensor "
                         f"(on its device, no copy to the host)")
    value = xxhash.xxh3_64_intdigest(memoryview(raw.numpy()))
    return value - (1 << 64) if value >= 1 << 63 else value
