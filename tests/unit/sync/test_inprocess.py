"""In-process transport and the factory (pure logic; the engine here is a recording stand-in)."""

import pytest
import torch

from megatron_rl.config.base import ConfigError
from megatron_rl.sync import SyncConfig, SyncError, build_weight_sync
from megatron_rl.sync.inprocess import InProcessWeightSync


class RecordingEngine:
    def __init__(self, name, honour_version=True):
        self.name, self.weight_version, self.loaded = name, 0, {}
        self.honour_version = honour_version

    def update_weights(self, named_tensors, version):
        self.loaded = {n: t.clone() for n, t in named_tensors}
        if self.honour_version:
            self.weight_version = version
        return {}


def _named():
    g = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(3, 4, generator=g)) for i in range(5)]


def test_every_engine_gets_every_tensor_from_a_single_pass_iterator():
    engines = [RecordingEngine("a"), RecordingEngine("b")]
    sync = build_weight_sync(SyncConfig(transport="inprocess"), engines)
    assert isinstance(sync, InProcessWeightSync)
    named = _named()
    metrics = sync.sync(iter(named), version=3)  # an iterator can be consumed only once
    for e in engines:
        assert e.weight_version == 3
        assert list(e.loaded) == [n for n, _ in named]
        assert all(torch.equal(e.loaded[n], t) for n, t in named)
    assert metrics.tensors == 5 and metrics.bytes == 5 * 12 * 4 and metrics.engines == 2


def test_engine_that_keeps_its_old_version_is_reported_by_name():
    sync = build_weight_sync(SyncConfig(transport="inprocess"), [RecordingEngine("stale", False)])
    with pytest.raises(SyncError, match="engine stale: weight_version is 0 after loading version 1"):
        sync.sync(iter(_named()), version=1)


def test_non_sender_rank_drains_the_collective_iterator():
    drained = []

    def export():
        for name, t in _named():
            drained.append(name)
            yield name, None

    engine = RecordingEngine("a")
    metrics = build_weight_sync(SyncConfig(), [engine], rank=1).sync(export(), version=2)
    assert len(drained) == 5 and engine.loaded == {} and metrics.tensors == 0


def test_factory_validates_and_refuses_gpu_transports_without_cuda():
    with pytest.raises(ConfigError, match="timeout_s"):
        build_weight_sync(SyncConfig(timeout_s=-1.0), [])
    if not torch.cuda.is_available():
        pytest.importorskip("vllm")
        for transport in ("nccl", "ipc"):
            with pytest.raises(SyncError, match="needs CUDA"):
                build_weight_sync(SyncConfig(transport=transport), [RecordingEngine("a")])


class ScoringEngine(RecordingEngine):
    """Scores the probe with a bigram table built from what it loaded (``keep_old``: it keeps
    scoring with the table it had, as an engine with a stale copy of a layer would)."""

    def __init__(self, name, keep_old=False):
        super().__init__(name)
        self.keep_old, self.table = keep_old, None

    def update_weights(self, named_tensors, version):
        super().update_weights(named_tensors, version)
        if self.table is None or not self.keep_old:
            self.table = torch.log_softmax(self.loaded["w0"].double(), -1)
        return {}

    def score(self, token_ids):
        return [float(self.table[a % 3, b % 4]) for a, b in zip(token_ids, token_ids[1:])]


def _reference(weights, tolerance=1e-6):
    from megatron_rl.sync.probe import ProbeReference, probe_tokens

    table = torch.log_softmax(dict(weights)["w0"].double(), -1)
    tokens = probe_tokens(12, 40)
    return ProbeReference(tokens=tokens, logprobs=[float(table[a % 3, b % 4]) for a, b in zip(tokens, tokens[1:])],
                          tolerance=tolerance)


def test_the_probe_fails_an_engine_that_computes_with_other_weights_than_it_received():
    from megatron_rl.sync import SyncMismatch

    good, stale = ScoringEngine("good"), ScoringEngine("stale", keep_old=True)
    sync = build_weight_sync(SyncConfig(transport="inprocess"), [good, stale])
    first = _named()
    sync.set_probe(_reference(first))
    m = sync.sync(iter(first), version=1)
    assert m.probe_gap_max < 1e-12 and m.as_dict()["sync/probe_gap_mean"] == m.probe_gap_mean
    second = [(n, t * 2.0 if n == "w0" else t) for n, t in first]  # (a shift would not show)
    sync.set_probe(_reference(second))
    with pytest.raises(SyncMismatch, match="engine stale: after the sync its log-probs of the probe"):
        sync.sync(iter(second), version=2)
    assert stale.weight_version == 2  # the version it reports says nothing: the probe saw it
    # without a probe (or without verify) nothing is scored
    sync.set_probe(None)
    assert sync.sync(iter(second), version=3).probe_gap_mean is None
