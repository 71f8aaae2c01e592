"""Inside every vLLM worker: record which experts each token was routed to (routing replay, R3).

:class:`RoutesWorkerExtension` is mixed into the workers of an engine (``worker_extension_cls`` of
the in-process engine, ``--worker-extension-cls`` of a server; the gloo weight sync's extension
extends it). The engine's front end calls two methods through ``collective_rpc``:

- ``mrl_routes_install()`` once at start-up: with vLLM's own routed-experts output on (GPUs, Model
  Runner V2) it only reports the MoE layers; otherwise it binds :class:`RouteCapture`, which uses the
  hook vLLM's own capturer binds (``router.set_capture_fn`` on every MoE runner), to the V1 model
  runner.
- ``mrl_routes_take(requests)`` after a request finished: its rows (and the token each row was
  computed on, which the front end checks against the completion), then forgotten.

How rows are kept. Each engine step's ``topk_ids`` arrive layer by layer as one ``[tokens, k]``
tensor in the runner's batch order (``input_batch.req_ids`` x ``num_scheduled_tokens``); request
``r``'s rows are positions ``num_computed_tokens[r] ...``. They are appended to the request's track
and also written into a buffer indexed by KV-cache slot, so that it mirrors the KV cache: a request
that starts on a cached prefix (prefix caching) takes that prefix's rows from the slots its blocks
point to, written by the forward that computed that KV. A position computed again (a preempted
request, or one whose KV a weight update dropped: partial rollouts) keeps its first row, the one of
the forward that sampled the next token. Tracks of finished requests nobody took (aborted copies)
are dropped after :data:`TTL_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import numpy as np

from megatron_rl.rollout.routes import RouteInfo, match_request, pack, route_dtype

log = logging.getLogger("megatron_rl")

TTL_S = 600.0  # a finished request's rows are kept this long for its front end to take them


class _Track:
    """One request's rows as computed, in order: ``(first position, offset, count, rows, tokens)``
    chunks, ``rows[offset:offset + count]`` being positions ``first ...`` (a step's arrays are
    shared by its requests' chunks: nothing is copied per step)."""

    __slots__ = ("chunks", "finished_at")

    def __init__(self):
        self.chunks: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []
        self.finished_at: float | None = None

    def assemble(self, layers: int, k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """Rows and tokens of positions 0.. up to the first never-computed one; a position
        computed more than once keeps its first row."""
        end = max((start + count for start, _, count, _, _ in self.chunks), default=0)
        rows = np.zeros((end, layers, k), dtype=dtype)
        tokens = np.full(end, -1, dtype=np.int64)
        have = np.zeros(end, dtype=bool)
        for start, off, count, r, t in self.chunks:
            stop = start + count
            new = ~have[start:stop]
            rows[start:stop][new] = r[off:off + count][new]
            tokens[start:stop][new] = t[off:off + count][new]
            have[start:stop] = True
        filled = int(np.argmin(have)) if not have.all() else end
        return rows[:filled], tokens[:filled]


class RouteCapture:
    """The capture state of one worker's V1 model runner (see the module doc)."""

    def __init__(self, runner, info: RouteInfo):
        self.runner = runner
        self.info = info
        self.dtype = route_dtype(info.num_experts)
        self.column = {layer: i for i, layer in enumerate(info.layers)}
        tables = runner.input_batch.block_table.block_tables
        self.table = tables[0]
        capacity = int(runner.kv_cache_config.num_blocks) * int(runner.cache_config.block_size)
        self.slot_rows = np.zeros((capacity, len(info.layers), info.top_k), dtype=self.dtype)
        self.slot_tokens = np.full(capacity, -1, dtype=np.int64)
        self.tracks: dict[str, _Track] = {}
        self.lock = threading.Lock()  # take() may come from another thread than the engine steps
        self.cached_rows = 0  # rows taken from the slots (prefix-cache hits), for the tests
        self._step: dict | None = None  # the current step's layout and rows, while its forward runs
        self._scheduler_output = None

    # ---------------------------------------------------------------- binding
    def bind(self) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        for module in self.runner.model.modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(partial(self.capture, module.layer_id))
        run = self.runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._scheduler_output, self._step = scheduler_output, None
            try:
                return run(scheduler_output, *args, **kwargs)
            finally:
                step, self._scheduler_output, self._step = self._step, None, None
                with self.lock:
                    if step is not None:
                        self._commit(step)
                    self._finished(scheduler_output.finished_req_ids)

        self.runner.execute_model = execute_model

    # ---------------------------------------------------------------- per layer, in the forward
    def capture(self, layer_id: int, topk_ids) -> None:
        if self._scheduler_output is None:  # a warm-up or profiling run: no requests
            return
        if self._step is None:
            self._step = self._layout()
        step = self._step
        n = step["total"]
        if topk_ids.shape[0] < n:
            raise RuntimeError(f"route capture: layer {layer_id} routed {topk_ids.shape[0]} tokens, the step "
                               f"scheduled {n}")
        step["rows"][:, self.column[layer_id]] = topk_ids[:n].cpu().numpy()

    def _layout(self) -> dict:
        """The step's token layout: which request and position each row is, and its KV slot."""
        batch = self.runner.input_batch
        so = self._scheduler_output
        ids = list(batch.req_ids)
        counts = np.array([so.num_scheduled_tokens[r] for r in ids], dtype=np.int64)
        starts = batch.num_computed_tokens_cpu[:len(ids)].astype(np.int64)
        total = int(counts.sum())
        req = np.repeat(np.arange(len(ids)), counts)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        pos = starts[req] + (np.arange(total) - offsets[req])
        size = self.table.block_size
        table = self.table.get_numpy_array()
        slots = table[req, pos // size].astype(np.int64) * size + pos % size
        tokens = batch.token_ids_cpu[req, pos].astype(np.int64)
        # a request seen for the first time that starts on a cached prefix: that prefix's slots
        cached = {}
        for i, (rid, start) in enumerate(zip(ids, starts)):
            if start > 0 and rid not in self.tracks:
                p = np.arange(int(start))
                cached[rid] = table[i, p // size].astype(np.int64) * size + p % size
        return {"ids": ids, "counts": counts, "starts": starts, "offsets": offsets, "total": total,
                "slots": slots, "tokens": tokens, "cached": cached,
                "rows": np.zeros((total, len(self.info.layers), self.info.top_k), dtype=self.dtype)}

    # ---------------------------------------------------------------- after the forward
    def _commit(self, step: dict) -> None:
        rows, tokens, slots = step["rows"], step["tokens"], step["slots"]
        # First the slots: a request may start on a prefix another one computed in this same step
        # (vLLM schedules the samples of an n > 1 request together, the later ones on the first's
        # blocks).
        self.slot_rows[slots] = rows
        self.slot_tokens[slots] = tokens
        tracks = self.tracks
        for rid, count, start, off in zip(step["ids"], step["counts"].tolist(), step["starts"].tolist(),
                                          step["offsets"].tolist()):
            track = tracks.get(rid)
            if track is None:
                track = tracks[rid] = _Track()
                cached = step["cached"].get(rid)
                if cached is not None:  # it starts on a cached prefix: that KV's rows, from its slots
                    track.chunks.append((0, 0, len(cached), self.slot_rows[cached], self.slot_tokens[cached]))
                    self.cached_rows += len(cached)
            track.chunks.append((start, off, count, rows, tokens))  # (the step's rows, not a copy)

    def _finished(self, finished_ids) -> None:
        now = time.monotonic()
        for rid in finished_ids or ():
            track = self.tracks.get(rid)
            if track is not None and track.finished_at is None:
                track.finished_at = now
        stale = [rid for rid, t in self.tracks.items() if t.finished_at is not None and now - t.finished_at > TTL_S]
        for rid in stale:
            del self.tracks[rid]

    # ---------------------------------------------------------------- the front end's call
    def take(self, requests: list) -> dict:
        """``{internal id: {"external", "index", "rows", "tokens"}}`` for every recorded request
        that is sample ``index`` of one of ``requests`` (``[external id, n]`` pairs); those tracks
        are forgotten."""
        wanted = {str(external): int(n) for external, n in requests}
        out = {}
        with self.lock:
            for rid in list(self.tracks):
                hit = match_request(rid, wanted)
                if hit is None:
                    continue
                rows, tokens = self.tracks.pop(rid).assemble(len(self.info.layers), self.info.top_k, self.dtype)
                out[rid] = {"external": hit[0], "index": hit[1], "rows": pack(rows), "tokens": pack(tokens)}
        return out


def moe_info(model) -> tuple[list[int], int, int]:
    """The MoE runners' decoder-layer indices (sorted), top-k and number of experts."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not runners:
        return [], 0, 0
    layers = sorted(int(m.layer_id) for m in runners)
    router = runners[0].router
    return layers, int(router.top_k), int(router.global_num_experts)


class RoutesWorkerExtension:
    """Mixed into every vLLM worker: routes of every token, for routing replay (see the module doc)."""

    def mrl_routes_install(self) -> dict:
        """Report the routing layers and, unless vLLM's own routed-experts output is on, bind the
        capture hook (idempotent). Returns :meth:`RouteInfo.to_dict`."""
        runner = self.model_runner
        layers, top_k, experts = moe_info(runner.model)
        if not layers:
            raise RuntimeError("routing replay: the served model has no MoE layers (no expert routes to return)")
        aux = getattr(self.vllm_config, "aux_output_config", None)
        native = bool(getattr(aux, "enable_return_routed_experts", False))
        info = RouteInfo(source="native" if native else "capture", layers=tuple(layers), top_k=top_k,
                         num_experts=experts)
        if not native and getattr(self, "_mrl_route_capture", None) is None:
            for name in ("input_batch", "kv_cache_config", "execute_model"):
                if not hasattr(runner, name):
                    raise RuntimeError(f"routing replay: route capture needs vLLM's V1 model runner; "
                                       f"{type(runner).__name__} has no {name!r} (on Model Runner V2 start "
                                       f"the engine with enable_return_routed_experts: "
                                       f"rollout.routes_source=native)")
            capture = RouteCapture(runner, info)
            capture.bind()
            self._mrl_route_capture = capture
        return info.to_dict()

    def mrl_routes_take(self, requests: list) -> dict:
        """The recorded rows of the samples of ``requests`` (``[external id, n]`` pairs); only the
        first tensor-parallel rank answers (the others hold the same rows)."""
        capture = getattr(self, "_mrl_route_capture", None)
        if capture is None:
            raise RuntimeError("routing replay: mrl_routes_take before mrl_routes_install")
        from vllm.distributed.parallel_state import get_tp_group

        if not get_tp_group().is_first_rank:
            return {}
        return capture.take(requests)
