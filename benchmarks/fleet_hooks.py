"""Hooks the rollout-fleet benchmark loads into its vLLM servers, through vLLM's extension points.

:class:`StepDelay`, a logits processor (``--logits-processors benchmarks.fleet_hooks:StepDelay``, the
delay in seconds read from the file named by ``MRL_BENCH_STEP_DELAY_FILE`` at every step, so the
benchmark sets it once it has measured the others' step time), loaded into one server only: vLLM
calls ``apply`` once per engine step on the whole batch, so every step of that engine takes this much longer (it
also counts the steps, in ``<file>.steps``),
while its sleeping worker leaves the CPU to the other servers. A straggler that uses no CPU (a
SIGSTOP-throttled engine is none on a shared box: the others get its stopped time). The logits are
returned unchanged, so it samples what the others do.

:class:`BenchWorkerExtension` (``--worker-extension-cls benchmarks.fleet_hooks.BenchWorkerExtension``)
is the product's :class:`~megatron_rl.sync.gloo.GlooWorkerExtension` (importing it registers the gloo
backend) plus one method, called through ``/collective_rpc``: the engine's own load of the model's
weights from its files, timed without any transfer, for the benchmark's second floor.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from megatron_rl.sync.gloo import GlooWorkerExtension

ENV = "MRL_BENCH_STEP_DELAY_FILE"


class StepDelay(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.path = os.environ.get(ENV, "")
        self.delay, self.mtime, self.steps = 0.0, None, 0

    def is_argmax_invariant(self) -> bool:
        return False  # applied to every batch, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        try:
            Path(self.path + ".tmp").write_text(str(self.steps))  # the benchmark counts our steps
            os.replace(self.path + ".tmp", self.path + ".steps")
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self.mtime:
                self.delay, self.mtime = float(Path(self.path).read_text() or 0), mtime
        except (OSError, ValueError):
            self.delay = 0.0
        if self.delay > 0:
            time.sleep(self.delay)
        return logits


class BenchWorkerExtension(GlooWorkerExtension):
    def mrl_bench_own_load(self, model_dir: str) -> dict:
        """Read the model's safetensors files (untimed), then time what a weight update costs the
        engine itself: vLLM's layerwise reload set-up, ``load_weights`` of every tensor (the layers
        are processed, i.e. repacked for the CPU kernels, as they complete) and its finalisation."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)

        from megatron_rl.rollout.reload import refresh_tied_layers

        engine = self.weight_transfer_engine
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        t0 = time.perf_counter()
        initialize_layerwise_reload(engine.model)
        t1 = time.perf_counter()
        engine.model.load_weights(iter(tensors.items()))
        t2 = time.perf_counter()
        finalize_layerwise_reload(engine.model, engine.model_config)
        refresh_tied_layers(engine.model)
        t3 = time.perf_counter()
        return {"seconds": t3 - t0, "start_seconds": t1 - t0, "load_seconds": t2 - t1,
                "finish_seconds": t3 - t2, "tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
