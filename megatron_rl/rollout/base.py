"""The rollout-engine interface: sample responses, take new weights, report their version.

One abstract class, one file per implementation (``vllm_engine.py`` in-process, ``remote.py`` an
engine in its own process), one factory (``megatron_rl.rollout.make_engine``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How to sample. ``n`` responses per prompt; ``max_tokens`` is the stage's max response length."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 64
    # Base seed: prompt i of the list is sampled with seed + i (None: engine RNG). Each prompt gets
    # its own stream, so prompts are not sampled with the same random draws, and a split of the list
    # across engines (shifting ``seed`` by each share's start) samples exactly what one engine would.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def prompt_seed(self, i: int) -> int | None:
        return None if self.seed is None else (self.seed + i) % (2**31 - 1)


@dataclass(kw_only=True)
class Completion:
    """One sampled response."""

    token_ids: list[int]
    # Log-prob of each sampled token under the engine's (processed: temperature, top-k/p) distribution.
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    # The response hit the max length without an end-of-sequence token (the seed's "truncated").
    truncated: bool
    # Version of the weights that sampled the first token (the oldest; see ``version_spans``).
    weight_version: int = 0
    # Partial rollouts: ``(version, start, end)`` per segment of response tokens [start, end) sampled
    # by one weight version, oldest first (vLLM's WeightVersionSpan). Empty: every token at
    # ``weight_version``.
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def token_versions(self) -> list[int]:
        """The weight version that sampled each response token."""
        if not self.version_spans:
            return [self.weight_version] * len(self.token_ids)
        out = [self.weight_version] * len(self.token_ids)
        for version, start, end in self.version_spans:
            out[start:end] = [version] * (end - start)
        return out

    @property
    def newest_version(self) -> int:
        return max((v for v, _, _ in self.version_spans), default=self.weight_version)

    @property
    def partial(self) -> bool:
        """Sampled across a weight update (tokens of more than one version)."""
        return len({v for v, _, _ in self.version_spans}) > 1


class RolloutEngine(ABC):
    """A generation engine whose weights the trainer replaces after every update."""

    weight_version: int = 0

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """``sampling.n`` completions for every prompt, in prompt order."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Load HF-named full tensors in place, reset the prefix cache, set ``weight_version``.

        Returns metrics (bytes, tensors, seconds)."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[1:]`` at T = 1 (the weight sync's probe)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (they were computed with older weights)."""

    def sleep(self) -> None:  # free KV cache while the trainer runs (colocated mode)
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass
