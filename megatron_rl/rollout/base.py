"""The rollout-engine interface, and the errors every engine raises.

One abstract class, one file per implementation (``vllm_engine.py``: vLLM in the trainer's process,
the CPU demo's and the unit tests' engine; ``server.py``: one vLLM server process driven over HTTP;
``fleet.py``: many servers behind one engine, with straggler-aware dispatch), one factory
(``megatron_rl.rollout.build_engine``).

What the trainer and the weight sync use, and nothing else: ``name``, ``weight_version`` (the
version the engine was last *verified* to hold, :data:`UNKNOWN_VERSION` after a failed sync),
``health()``, ``generate()`` (a batch, in prompt order) and ``submit()`` (one prompt, awaitable:
what continuous dispatch is built on), ``pause(mode)`` / ``resume()``, ``reset_prefix_cache()``,
``sleep()`` / ``wake_up()``, ``score()`` (the weight sync's probe), ``pop_metrics()``, ``close()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

# The weight version of an engine whose last sync failed part-way: its weights are a mix of old
# and new (or corrupted) tensors until the next successful sync. Rollouts tagged with it are void.
UNKNOWN_VERSION = -1

# vLLM's pause modes: "abort" in-flight requests (they return partial tokens, finish reason
# "abort"), "wait" for them to finish, or "keep" them frozen until ``resume`` (same tokens as an
# unpaused run).
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


class EngineError(RuntimeError):
    """An engine failed, died or did not answer in time; the message names the engine."""


class EngineDied(EngineError):
    """The engine's process is gone (or refuses connections)."""


class EngineTimeout(EngineError):
    """The engine did not answer within its timeout (hung, stopped, or overloaded)."""


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How to sample. ``n`` responses per prompt; ``max_tokens`` is the stage's max response length."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 64
    # Base seed: prompt i of a batch is sampled with seed + i (None: engine RNG), and its sample j
    # with seed + i + j (vLLM's rule for n > 1). Each prompt gets its own stream, so prompts are not
    # sampled with the same draws, and whichever engine serves prompt i samples the same responses.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Every response is at least this many tokens: end-of-sequence and stop tokens are not sampled
    # before (vLLM's ``min_tokens``; ``max_tokens`` too: a response as long as the window it needs).
    min_tokens: int = 0
    # Per-prompt overrides for a batch whose prompts are sampled each its own way (the turns of
    # multi-turn trajectories: each has its own seed and its own room left): when set, prompt i is
    # seeded ``seeds[i]`` and samples at most ``max_tokens_each[i]`` tokens.
    seeds: tuple[int, ...] = ()
    max_tokens_each: tuple[int, ...] = ()

    def prompt_seed(self, i: int) -> int | None:
        if self.seeds:
            return self.seeds[i]
        return None if self.seed is None else (self.seed + i) % (2**31 - 1)

    def prompt_max_tokens(self, i: int) -> int:
        return self.max_tokens_each[i] if self.max_tokens_each else self.max_tokens

    def for_prompt(self, i: int) -> "SamplingSpec":
        """The spec of prompt ``i`` of a batch sent alone: its own seed (and length), as prompt 0."""
        if self.seed is None and not self.seeds and not self.max_tokens_each:
            return self
        return dataclasses.replace(self, seed=self.prompt_seed(i), max_tokens=self.prompt_max_tokens(i),
                                   seeds=(), max_tokens_each=())


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
    # Which engine sampled it.
    engine: str = ""
    # Multi-turn trajectories (``rollout/multi_turn.py``): 1 for each token the model sampled, 0 for
    # the tokens of a tool's observation appended between its turns (trained on never; their
    # ``logprobs`` are 0.0). Empty: every token is the model's.
    loss_mask: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def model_tokens(self) -> list[bool]:
        """Whether each response token was sampled by the model (not a tool's observation)."""
        return [bool(m) for m in self.loss_mask] if self.loss_mask else [True] * len(self.token_ids)

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

    name: str = "engine"
    # The version of the weights this engine was last verified to hold (UNKNOWN_VERSION: unknown).
    weight_version: int = 0

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """``sampling.n`` completions for every prompt, in prompt order (prompt i: seed + i)."""

    async def submit(self, prompt_ids: list[int], sampling: SamplingSpec) -> list[Completion]:
        """``sampling.n`` completions of one prompt, sampled with ``sampling.seed`` (awaitable).

        Default: a one-prompt ``generate`` in a worker thread (engines with their own event loop
        override this)."""
        return (await asyncio.to_thread(self.generate, [prompt_ids], sampling))[0]

    def health(self) -> bool:
        """True if the engine answers (a cheap liveness check with a short timeout)."""
        return True

    def set_weight_version(self, version: int) -> None:
        """Record (and, for a server, tell the engine) the version its weights are known to be."""
        self.weight_version = version

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[1:]`` at T = 1 (the weight sync's probe)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (they were computed with older weights)."""

    def pause(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling: ``abort``, ``wait`` for or ``keep`` (freeze) in-flight requests."""
        raise EngineError(f"engine {self.name}: pause is not supported by {type(self).__name__}")

    def resume(self) -> None:
        """Resume scheduling after ``pause``."""
        raise EngineError(f"engine {self.name}: resume is not supported by {type(self).__name__}")

    def sleep(self) -> None:  # free KV cache (and offload weights) while the trainer runs (colocated)
        pass

    def wake_up(self) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the last call (``rollout/...``), e.g. re-sent requests."""
        return {}

    def close(self) -> None:
        pass
