"""The device-side bucket checksum (``megatron_rl.sync.buckets.hash_tensor``) on a GPU: computed where
the bytes are (no copy of the weights to the host), and the same value as on the CPU, so both ends of a
transfer agree whichever device each holds the bucket on; a changed byte or two swapped words change
it (prepared; skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_device_hash_stays_on_the_device_and_equals_the_host_value():
    from megatron_rl.sync.buckets import checksum, hash_tensor

    g = torch.Generator().manual_seed(0)
    for n in (13, 8 * 1000 + 5, 8 * 1024 * 300 + 3):  # tail only, one pass, rows of 1024 words
        host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        dev = host.cuda()
        h = hash_tensor(dev)
        assert h.device == dev.device and h.dtype == torch.int64 and h.dim() == 0
        assert checksum(dev) == checksum(host)
        flipped = dev.clone()
        flipped[n // 2] ^= 1
        assert checksum(flipped) != checksum(dev)
        if n >= 16:
            swapped = dev.clone()
            words = swapped[: (n // 8) * 8].view(torch.int64)
            words[[0, -1]] = words[[-1, 0]].clone()
            assert checksum(swapped) != checksum(dev) or bool((words[0] == words[-1]).item())
