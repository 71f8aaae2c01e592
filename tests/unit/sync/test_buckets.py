"""Bucket packing, unpacking and checksums, against plain tensor equality."""

import pytest
import torch

from megatron_rl.config.base import ConfigError
from megatron_rl.sync.base import SyncMismatch, compare_checksums
from megatron_rl.sync.buckets import (ALIGN, BucketMeta, checksum, group_by_dtype, layout, pack,
                                      unpack)
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
def test_round_trip_all_tensors_equal(bucket_bytes):
    named = _model_like()
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    got = {}
    for k, items in enumerate(group_by_dtype(iter(named), bucket_bytes)):
        assert len({t.dtype for _, t in items}) == 1, "a bucket mixes dtypes"
        meta, data = pack(items, k, buffer)
        assert data.numel() <= bucket_bytes or len(items) == 1
        wire = BucketMeta.decode(meta.encode())  # header travels as bytes
        assert wire == meta
        received = data.clone()  # what the engine sees: a separate buffer
        for name, tensor in unpack(wire, received):
            assert name not in got
            got[name] = tensor.clone()
    assert list(got) != [] and set(got) == {n for n, _ in named}
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_oversized_tensor_travels_alone_without_copy():
    big = torch.randn(1000)
    buckets = list(group_by_dtype(iter([("a", torch.randn(3)), ("big", big)]), 1024))
    assert [[n for n, _ in b] for b in buckets] == [["big"], ["a"]]
    meta, data = pack(buckets[0], 0, torch.empty(1024, dtype=torch.uint8))
    assert data.data_ptr() == big.data_ptr()


def test_bucket_is_emitted_when_full_and_offsets_aligned():
    named = [(f"t{i}", torch.zeros(40)) for i in range(10)]  # 160 B each -> 192 aligned
    buckets = list(group_by_dtype(iter(named), 1024))
    assert [len(b) for b in buckets] == [5, 5]
    meta = layout(buckets[0], 0)
    assert all(t.offset % ALIGN == 0 for t in meta.tensors)
    assert meta.nbytes <= 1024


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


def test_compare_checksums_names_engine_and_tensor():
    compare_checksums("e0", {"a": 1, "b": 2}, {"a": 1, "b": 2})
    with pytest.raises(SyncMismatch, match=r"engine e1: checksum mismatch on tensor 'b'"):
        compare_checksums("e1", {"a": 1, "b": 2}, {"a": 1, "b": 3})
    with pytest.raises(SyncMismatch, match=r"tensor 'b' was not received"):
        compare_checksums("e1", {"a": 1, "b": 2}, {"a": 1})


def test_config_rejects_bad_values_naming_the_key():
    SyncConfig().validate()
    with pytest.raises(ConfigError, match=r"sync.transport"):
        SyncConfig.from_dict({"transport": "tcp"}, prefix="sync")
    with pytest.raises(ConfigError, match=r"sync.bucket_bytes"):
        cfg = SyncConfig.from_dict({"bucket_bytes": 10}, prefix="sync")
        cfg.validate()
    with pytest.raises(ConfigError, match=r"sync.timeout_s"):
        SyncConfig.from_dict({"timeout_s": 0}, prefix="sync").validate()
    with pytest.raises(ConfigError, match=r"sync.bucket_size"):
        SyncConfig.from_dict({"bucket_size": 10}, prefix="sync")


def test_batched_checksums_equal_single_ones_on_every_size_path():
    from megatron_rl.sync.buckets import checksums

    g = torch.Generator().manual_seed(1)
    named = [("small", torch.randn(5, generator=g)), ("odd", torch.randint(0, 9, (13,), dtype=torch.uint8)),
             ("rows", torch.randn(4096 + 3, generator=g)), ("empty", torch.zeros(0))]
    assert checksums(iter(named)) == {n: checksum(t) for n, t in named}
    big = named[2][1].clone()
    big[1024 * 2 + 1], big[1024 * 2 + 5] = big[1024 * 2 + 5].item(), big[1024 * 2 + 1].item()  # swap in a row
    assert checksum(big) != checksum(named[2][1])
