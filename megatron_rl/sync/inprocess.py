"""The engine lives in the trainer's process (the CPU demo): hand it the tensors directly."""

from __future__ import annotations

import time
from collections.abc import Sequence

from megatron_rl.sync import probe
from megatron_rl.sync.base import NamedTensors, SyncError, SyncMetrics, WeightSync, drain
from megatron_rl.sync.config import SyncConfig


class InProcessWeightSync(WeightSync):
    """Calls ``engine.update_weights(named_tensors, version)`` on every engine (vLLM's in-place
    layerwise reload, then a prefix-cache reset: :class:`~megatron_rl.rollout.vllm_engine.VLLMEngine`).

    With ``verify`` the engine must then report ``weight_version == version`` and match the probe
    (:mod:`megatron_rl.sync.probe`) when the trainer set one; the bytes are the trainer's own
    tensors, so there is nothing in flight to checksum.
    """

    def __init__(self, config: SyncConfig, engines: Sequence, *, sender: bool = True):
        super().__init__(config)
        self.engines = list(engines)
        self.sender = sender

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        t0 = time.perf_counter()
        if not self.sender:
            return drain(named_tensors, version)
        # one engine streams; several need the tensors more than once
        tensors = named_tensors if len(self.engines) == 1 else list(named_tensors)
        counted: list[tuple[str, object]] = []

        def counting():
            for name, tensor in tensors:
                counted.append((name, tensor.numel() * tensor.element_size()))
                yield name, tensor

        metrics = SyncMetrics(version=version, engines=len(self.engines), verified=self.config.verify)
        for i, engine in enumerate(self.engines):
            engine.update_weights(counting() if i == 0 else iter(tensors), version)
            if self.config.verify and engine.weight_version != version:
                raise SyncError(f"engine {getattr(engine, 'name', i)}: weight_version is "
                                f"{engine.weight_version} after loading version {version}")
            if self.config.verify and self.probe is not None:
                metrics.add_probe_gap(probe.check(engine, self.probe))  # SyncMismatch past the tolerance
        metrics.seconds = time.perf_counter() - t0
        metrics.bytes, metrics.tensors = sum(n for _, n in counted), len(counted)
        return metrics


def build(config: SyncConfig, engines, *, sender: bool, metadata=None) -> InProcessWeightSync:
    """``engines``: the engine (or a list of them); None on the non-sending ranks."""
    if engines is None:
        engines = []
    elif not isinstance(engines, (list, tuple)):
        engines = [engines]
    return InProcessWeightSync(config, list(engines), sender=sender)
