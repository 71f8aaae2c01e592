"""Bucket planning, packing and checksums, against plain tensor equality; the receiving end unpacks
with vLLM's own ``unpack_tensor`` from a plan computed from the metadata alone (what a server does)."""

import pytest
import torch

from megatron_rl.config.base import ConfigError
from megatron_rl.sync.buckets import bucket_nbytes, checksum, group_by_dtype, meta_tensors, nbytes, pack
from megatron_rl.sync.config import SyncConfig


def _model_like(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [("embed", torch.randn(50, 16, generator=g)),
           ("scalar", torch.tensor(3.5)),
           ("odd_bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
           ("ids", torch.arange(13, dtype=torch.int64)),
           ("mask", torch.tensor([True, False, True])),
           ("big", torch.randn(600, generator=g)),
           ("half", torch.randn(3, 5, generator=g).to(torch.float16))]
    out += [(f"layer{i}.w", torch.randn(4, 9, generator=g)) for i in range(20)]
    out.append(("transposed", torch.randn(6, 4, generator=g).t()))  # non-contiguous
    return out


@pytest.mark.parametrize("bucket_bytes", [1024, 2048, 1 << 20])
def test_round_trip_through_a_receiver_that_plans_from_metadata(bucket_bytes):
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    named = _model_like()
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    sent = list(group_by_dtype(iter(named), bucket_bytes))
    plan = list(group_by_dtype(meta_tensors(names, dtypes, shapes), bucket_bytes))
    assert [[n for n, _ in b] for b in sent] == [[n for n, _ in b] for b in plan]
    got = {}
    for items, planned in zip(sent, plan):
        assert len({t.dtype for _, t in items}) == 1, "a bucket mixes dtypes"
        data = pack(items, buffer)
        assert data.numel() == bucket_nbytes(planned)
        assert data.numel() <= bucket_bytes or len(items) == 1
        received = data.clone()  # what the engine sees: a separate buffer
        for name, tensor in unpack_tensor(received, [n for n, _ in planned], [list(t.shape) for _, t in planned],
                                          [t.dtype for _, t in planned], [nbytes(t) for _, t in planned]):
            assert name not in got
            got[name] = tensor.clone()
    assert set(got) == set(names)
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_oversized_tensor_travels_alone_without_copy():
    big = torch.randn(1000)
    buckets = list(group_by_dtype(iter([("a", torch.randn(3)), ("big", big)]), 1024))
    assert [[n for n, _ in b] for b in buckets] == [["big"], ["a"]]
    data = pack(buckets[0], torch.empty(1024, dtype=torch.uint8))
    assert data.data_ptr() == big.data_ptr()


def test_bucket_is_emitted_when_full():
    named = [(f"t{i}", torch.zeros(40)) for i in range(10)]  # 160 B each
    buckets = list(group_by_dtype(iter(named), 1024))
    assert [len(b) for b in buckets] == [6, 4]
    assert all(bucket_nbytes(b) <= 1024 for b in buckets)


def test_duplicate_name_is_refused():
    with pytest.raises(ValueError, match="'w' exported twice"):
        list(group_by_dtype(iter([("w", torch.zeros(2)), ("w", torch.zeros(2))]), 1024))


def test_checksum_detects_changes_moves_and_matches_across_copies():
    x = torch.randn(5000)
    base = checksum(x)
    assert checksum(x.clone()) == base
    for index in (0, 1023, 1024, 4999):  # body, row boundary, tail
        y = x.clone()
        y[index] += 1.0
        assert checksum(y) != base, index
    swapped = x.clone()
    swapped[[10, 2000]] = swapped[[2000, 10]]
    assert checksum(swapped) != base
    rolled = torch.roll(x, 1)
    assert checksum(rolled) != base
    # bytes, not values: -0.0 and 0.0 differ, as the loader would see them
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    odd = torch.arange(11, dtype=torch.uint8)
    odd2 = odd.clone()
    odd2[10] = 99
    assert checksum(odd) != checksum(odd2)
    big = torch.randn(4096 + 3)
    swap = big.clone()
    swap[1024 * 2 + 1], swap[1024 * 2 + 5] = big[1024 * 2 + 5].item(), big[1024 * 2 + 1].item()  # in a row
    assert checksum(swap) != checksum(big)


def test_config_rejects_bad_values_naming_the_key():
    SyncConfig().validate()
    with pytest.raises(ConfigError, match=r"sync.transport.*'gloo'.*got 'tcp'"):
        SyncConfig.from_dict({"transport": "tcp"}, prefix="sync").validate()
    with pytest.raises(ConfigError, match=r"sync.bucket_bytes"):
        SyncConfig.from_dict({"bucket_bytes": 10}, prefix="sync").validate()
    with pytest.raises(ConfigError, match=r"sync.timeout_s"):
        SyncConfig.from_dict({"timeout_s": 0}, prefix="sync").validate()
    with pytest.raises(ConfigError, match=r"sync.retries"):
        SyncConfig.from_dict({"retries": -1}, prefix="sync").validate()
    with pytest.raises(ConfigError, match=r"sync.bucket_size"):
        SyncConfig.from_dict({"bucket_size": 10}, prefix="sync")


def test_host_digest_changes_with_any_byte_and_with_two_words_swapped():
    """The gloo transport's bucket checksum (XXH3-64 of the bytes, read in place): equal to the
    library's hash of the same bytes copied out (the reference), the same on a copy, and different
    when any single byte changes or any two 8-byte words trade places."""
    import xxhash

    from megatron_rl.sync import gloo_wire
    from megatron_rl.sync.buckets import host_digest

    assert gloo_wire.BUCKET_HASH is host_digest  # the one definition both ends of the transport use
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8 * 96 + 5,), dtype=torch.uint8, generator=g)  # whole words and a tail
    base = host_digest(data)
    assert base == host_digest(data.clone())
    ref = xxhash.xxh3_64_intdigest(bytes(data.tolist()))
    assert base & ((1 << 64) - 1) == ref and -(1 << 63) <= base < (1 << 63)  # fits an int64 tensor
    for i in range(data.numel()):  # every byte position, one bit and a whole-byte change
        for delta in (1, 0x80):
            changed = data.clone()
            changed[i] ^= delta
            assert host_digest(changed) != base, (i, delta)
    words = data[: 8 * 96].view(torch.int64)
    for i in range(96):
        for j in range(i + 1, 96):
            if words[i] == words[j]:
                continue
            swapped = data.clone()
            sw = swapped[: 8 * 96].view(torch.int64)
            sw[i], sw[j] = words[j].item(), words[i].item()
            assert host_digest(swapped) != base, (i, j)
    # a float tensor is hashed by its bytes: -0.0 and 0.0 differ
    assert host_digest(torch.tensor([0.0])) != host_digest(torch.tensor([-0.0]))
    # in place: the digest of a bucket slice reads that slice, not the buffer around it
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[:16] = data[:16]
    assert host_digest(buf[:16]) == host_digest(data[:16])
