"""Data-parallel rollout replicas behind the one ``RolloutEngine`` interface.

The prompt list is cut into contiguous shares, one per engine, generated concurrently, and the
results come back in prompt order. Each share's sampling seed is shifted by its start index, so the
pool samples exactly what a single engine would for the same weights (see ``SamplingSpec.seed``).
Weights reach the replicas through the weight sync (``megatron_rl.sync``), which is given the
engines themselves; ``update_weights`` here is the plain fallback that loads each in turn.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import Iterable

import torch

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingSpec


def shares(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous [lo, hi) ranges covering ``n`` items, sizes differing by at most one."""
    bounds = [round(i * n / k) for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class EnginePool(RolloutEngine):
    def __init__(self, engines: list[RolloutEngine], timeout_s: float = 600.0):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self._threads = cf.ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="engine-pool")

    @property
    def weight_version(self) -> int:  # the oldest policy any replica holds
        return min(e.weight_version for e in self.engines)

    @weight_version.setter
    def weight_version(self, value: int) -> None:  # set by RolloutEngine's default; ignored
        pass

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        jobs = []
        for engine, (lo, hi) in zip(self.engines, shares(len(prompt_ids), len(self.engines))):
            if hi == lo:
                continue
            spec = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.prompt_seed(lo))
            jobs.append(self._threads.submit(engine.generate, prompt_ids[lo:hi], spec))
        out: list[list[Completion]] = []
        for job in jobs:  # in share order = prompt order; each engine call has its own timeout too
            out.extend(job.result(timeout=self.timeout_s))
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        tensors = list(named_tensors)
        metrics: dict = {}
        for e in self.engines:
            metrics = e.update_weights(iter(tensors), version)
        return metrics

    def reset_prefix_cache(self) -> None:
        for e in self.engines:
            e.reset_prefix_cache()

    def sleep(self) -> None:
        for e in self.engines:
            e.sleep()

    def wake_up(self) -> None:
        for e in self.engines:
            e.wake_up()

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self._threads.shutdown(wait=False)
