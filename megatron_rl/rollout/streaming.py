"""Group-at-a-time generation for asynchronous GRPO (``rollout.async``).

The async rollout scheduler (``megatron_rl.trainer.async_rollout``) hands prompts to a
:class:`GroupStream` and is called back with every group (one prompt's ``n`` samples) as it
finishes, while the trainer trains on earlier ones (``megatron_rl.rollout.group_stream`` picks one).
Three implementations; the fleet of vLLM servers' is ``megatron_rl.rollout.fleet_stream``. Here:

- :class:`BackgroundGenerate` wraps any other :class:`RolloutEngine`: each
  ``submit`` is one ``generate`` call on a background thread; the whole list finishes at once, and
  weights can only be loaded once it has (``keeps_in_flight`` is False).
- :class:`StreamingVLLMEngine` is the in-process vLLM engine stepped by a thread of ours
  (``LLM.enqueue`` + ``LLMEngine.step``). Every other call (weight loads, evaluation, cache resets)
  runs on that thread between two engine steps, so weights can be loaded with requests in flight:
  the in-process equivalent of the server's ``/pause?mode=keep`` + load + ``/resume``. The running
  requests' KV caches are recomputed with the new weights (vLLM's
  ``reset_prefix_cache(reset_running_requests=True)``), and vLLM labels the tokens each version
  sampled (``set_weight_version`` -> ``CompletionOutput.weight_versions``), which become the
  completions' ``version_spans``.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Hashable, Iterable

import torch

from megatron_rl.rollout.base import Completion, EngineTimeout, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine

log = logging.getLogger("megatron_rl")

# on_done receives [(tag, completions of that prompt)] for every group that finished together.
OnDone = Callable[[list[tuple[Hashable, list[Completion]]]], None]


class GroupStream(ABC):
    """What the async scheduler needs from an engine."""

    # Weights can be loaded while requests are in flight (they continue with the new weights).
    keeps_in_flight: bool = False
    # Groups whose generation can be stopped early (``abort``).
    can_abort: bool = False

    @abstractmethod
    def submit(self, prompt_ids: list[list[int]], sampling: SamplingSpec, tags: list[Hashable],
               on_done: OnDone) -> None:
        """Start generating ``sampling.n`` samples for each prompt (prompt i seeded with
        ``sampling.prompt_seed(i)``); returns at once. ``on_done`` is called from the engine's
        thread; a failure is delivered as ``on_done([(tag, exc)])`` for every tag."""

    def abort(self, tags: Iterable[Hashable]) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot abort requests")

    @abstractmethod
    def busy_seconds(self) -> float:
        """Cumulative seconds spent generating (idle time = wall time - busy time)."""

    @abstractmethod
    def in_flight(self) -> int:
        """Groups submitted and not yet delivered."""

    def last_progress(self) -> float | None:
        """``time.monotonic()`` of the engine's last sign of progress on what is in flight (a request
        sent or re-sent, one answered, a recovery under way: now), so a waiter's watchdog measures
        ``rollout.timeout_s`` from it rather than from when it began to wait; None: no such signal (the
        watchdog counts from the start of the wait)."""
        return None

    def stop_with_partials(self) -> bool:
        """Stop everything in flight now, each request answering with what it generated so far
        (finish reason ``abort`` for the samples it stopped); False: this engine cannot (its
        requests are then left as they are)."""
        return False

    def before_weight_update(self) -> None:
        """Partial rollouts: freeze what is in flight before new weights are loaded (servers:
        ``/pause?mode=keep``). Default: nothing (the engine loads weights between two steps)."""

    def after_weight_update(self) -> None:
        """Partial rollouts: continue what :meth:`before_weight_update` froze."""


class BackgroundGenerate(GroupStream):
    """Any engine: one ``engine.generate`` per ``submit``, run in order on one background thread."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-bg")
        self._busy = 0.0
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, prompt_ids, sampling, tags, on_done) -> None:
        with self._lock:
            self._pending += len(tags)

        def run():
            t0 = time.perf_counter()
            try:
                groups = self.engine.generate(prompt_ids, sampling)
                result = list(zip(tags, groups))
            except Exception as exc:  # noqa: BLE001 - delivered to the scheduler, which raises it
                result = [(t, exc) for t in tags]
            finally:
                with self._lock:
                    self._busy += time.perf_counter() - t0
                    self._pending -= len(tags)
            on_done(result)

        self._pool.submit(run)

    def busy_seconds(self) -> float:
        with self._lock:
            return self._busy

    def in_flight(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamingVLLMEngine(VLLMEngine, GroupStream):
    """In-process vLLM whose engine loop is ours: requests stream in and out, and weights are
    loaded between two engine steps with requests in flight."""

    keeps_in_flight = True
    can_abort = True

    def __init__(self, model_path: str, cfg: RolloutConfig, **kwargs):
        super().__init__(model_path, cfg, **kwargs)
        self._pool.shutdown(wait=True)  # VLLMEngine's call thread: our loop thread replaces it
        self._commands: queue.Queue = queue.Queue()
        self._requests: dict[str, tuple[Hashable, OnDone]] = {}  # vLLM request id -> (tag, on_done)
        self._by_tag: dict[Hashable, str] = {}
        self._busy = 0.0
        self._closed = False
        self._ids = itertools.count()
        self._scores: dict[str, cf.Future] = {}  # vLLM request id -> the caller of score()
        self.llm.llm_engine.set_weight_version(str(self.weight_version))
        self._thread = threading.Thread(target=self._loop, name=f"vllm-{self.name}-loop", daemon=True)
        self._thread.start()

    # -- the loop: commands between engine steps ------------------------------------------------
    def _loop(self) -> None:
        engine = self.llm.llm_engine
        while not self._closed:
            busy = engine.has_unfinished_requests()
            try:
                cmd = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                cmd = None
            if cmd is not None:
                fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                        fut.set_exception(exc)
                continue  # drain every queued command before the next step
            if busy:
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except BaseException as exc:  # noqa: BLE001 - a dead engine fails every request
                    self._fail_all(exc)
                    raise
                self._busy += time.perf_counter() - t0
                self._deliver([o for o in outputs if o.finished])

    def _deliver(self, finished) -> None:
        done = []
        for out in finished:
            scored = self._scores.pop(out.request_id, None)
            if scored is not None:  # a probe (score), not a group
                scored.set_result(out)
                continue
            entry = self._requests.pop(out.request_id, None)
            if entry is None:  # aborted meanwhile
                continue
            tag, on_done = entry
            self._by_tag.pop(tag, None)
            done.append((on_done, tag, self.group(out)))
        _notify(done)

    def _fail_all(self, exc: BaseException) -> None:
        scores, self._scores = self._scores, {}
        for fut in scores.values():
            fut.set_exception(exc)
        pending, self._requests = self._requests, {}
        self._by_tag.clear()
        _notify([(on_done, tag, exc) for tag, on_done in pending.values()])

    def _call(self, fn, *args, timeout: float | None = None):
        """Run ``fn`` on the loop thread between two engine steps; every wait has a timeout."""
        if self._closed:
            raise RuntimeError(f"{self.name}: engine is closed")
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: cf.Future = cf.Future()
        self._commands.put((lambda: fn(*args), fut))
        limit = timeout or self.cfg.timeout_s
        try:
            return fut.result(timeout=limit)
        except cf.TimeoutError:
            raise EngineTimeout(f"{self.name}: no answer within rollout.timeout_s={limit}s "
                                f"in {getattr(fn, '__name__', fn)}") from None

    # -- GroupStream ------------------------------------------------------------------------------
    def submit(self, prompt_ids, sampling, tags, on_done) -> None:
        prompts, params = self.requests(prompt_ids, sampling)

        def add():
            ids = self.llm.enqueue(prompts, params, use_tqdm=False)
            for rid, tag in zip(ids, tags):
                external = rid.rsplit("-", 1)[0]  # vLLM appends a random suffix internally
                self._requests[external] = (tag, on_done)
                self._by_tag[tag] = external

        self._call(add)

    def abort(self, tags: Iterable[Hashable]) -> None:
        tags = list(tags)

        def drop():
            ids = [self._by_tag.pop(t) for t in tags if t in self._by_tag]
            for rid in ids:
                self._requests.pop(rid, None)
            if ids:
                self.llm.llm_engine.abort_request(ids)
            return len(ids)

        self._call(drop)

    def busy_seconds(self) -> float:
        return self._busy

    def in_flight(self) -> int:
        return len(self._requests)

    # -- RolloutEngine ------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """Blocking generation (evaluation, tools); it shares the engine with requests in flight."""
        done = threading.Event()
        results: dict[int, list[Completion] | BaseException] = {}

        def collect(groups):
            results.update(groups)
            if len(results) == len(prompt_ids):
                done.set()

        tag0 = f"generate-{next(self._ids)}"
        self.submit(prompt_ids, sampling, [(tag0, i) for i in range(len(prompt_ids))],
                    lambda gs: collect([(t[1], g) for t, g in gs]))
        if prompt_ids and not done.wait(self.cfg.timeout_s):
            self.abort([(tag0, i) for i in range(len(prompt_ids))])
            raise EngineTimeout(f"{self.name}: generate did not finish within rollout.timeout_s="
                                f"{self.cfg.timeout_s}s")
        for r in results.values():
            if isinstance(r, BaseException):
                raise r
        return [results[i] for i in range(len(prompt_ids))]

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs at T = 1 (the sync's probe), through the loop: the engine is
        shared with requests in flight, whose outputs a plain ``llm.generate`` would swallow."""
        prompt, params = self.score_request(token_ids)
        done: cf.Future = cf.Future()

        def add():
            rid = self.llm.enqueue([prompt], [params], use_tqdm=False)[0]
            self._scores[rid.rsplit("-", 1)[0]] = done  # vLLM appends a random suffix internally

        self._call(add)
        try:
            out = done.result(timeout=self.cfg.timeout_s)
        except cf.TimeoutError:
            raise EngineTimeout(f"{self.name}: the probe was not scored within rollout.timeout_s="
                                f"{self.cfg.timeout_s}s") from None
        return self.prompt_logprobs(out, token_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Load weights between two engine steps; requests in flight continue with them."""
        t0 = time.perf_counter()
        tensors = [(n, t.detach().to("cpu" if not torch.cuda.is_available() else t.device).contiguous())
                   for n, t in named_tensors]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)

        def load():
            engine = self.llm.llm_engine
            self.reload(tensors)
            # Running requests are preempted and recomputed: their KV (old weights) is dropped.
            engine.reset_prefix_cache(reset_running_requests=True)
            engine.set_weight_version(str(version))
            return engine.get_num_unfinished_requests()

        in_flight = self._call(load)
        self.weight_version = version
        return {"sync/bytes": float(nbytes), "sync/tensors": float(len(tensors)),
                "sync/seconds": time.perf_counter() - t0, "sync/requests_in_flight": float(in_flight)}

    def reset_prefix_cache(self) -> None:
        self._call(lambda: self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True))

    def close(self) -> None:
        if not self._closed:
            try:
                self._call(lambda: self.llm.llm_engine.abort_request(list(self._requests)), timeout=30)
            except Exception:  # noqa: BLE001 - closing must not mask the run's own error
                pass
            self._closed = True
            self._commands.put((lambda: None, cf.Future()))  # wake the loop
            self._thread.join(timeout=30)
        del self.llm


def _notify(done: list[tuple[OnDone, Hashable, object]]) -> None:
    """One ``on_done`` call per callback with all of its groups that finished together."""
    by_callback: dict[int, tuple[OnDone, list]] = {}
    for on_done, tag, result in done:
        by_callback.setdefault(id(on_done), (on_done, []))[1].append((tag, result))
    for on_done, groups in by_callback.values():
        on_done(groups)
