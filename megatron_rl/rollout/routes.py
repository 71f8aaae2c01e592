"""MoE routes: which experts the engine's router chose for every token (routing replay, R3).

A sequence's routes are an integer array ``[positions, moe_layers, top_k]`` (``uint8`` when the model
has at most 256 experts, else ``int16``): row ``p`` holds, for every MoE layer in model order, the
top-k expert ids the router chose for the hidden state at position ``p``. An engine returns, with
each completion, the rows of the prompt and of every response token but the last
(``len(prompt) + len(response) - 1`` rows: the last sampled token is never fed through the model),
each from the forward pass that computed it; so the row that predicts response token ``i``
(position ``len(prompt) - 1 + i``) comes from the weight version that sampled token ``i``.

Where the rows come from (``rollout.routes_source``):

- ``native`` (GPUs): vLLM's own ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``,
  the generate route's ``routed_experts``: rows for every decoder layer, of which the MoE ones are
  kept). vLLM 0.32 runs it on Model Runner V2 only, which needs Triton's GPU backend.
- ``capture`` (CPU, or V1 GPU runners): the capture hook vLLM's own capturer binds
  (``router.set_capture_fn`` on every MoE runner), installed by our worker extension
  (:mod:`megatron_rl.rollout.route_capture`) in every engine, in-process or server.

Either way the engine is started with :data:`ROUTES_EXTENSION` and asked once, at start-up, which
source is live and which layers route (:class:`RouteInfo`). This module holds what both sides share
(the wire format, the request-id rule, the checks); it imports no vLLM.
"""

from __future__ import annotations

import base64
import dataclasses
import re

import numpy as np

from megatron_rl.rollout.base import EngineError
from megatron_rl.rollout.config import ROUTE_SOURCES as SOURCES

# The worker extension that installs the capture hook and hands the rows out (``--worker-extension-cls``
# of a server, ``worker_extension_cls`` of the in-process engine). The gloo weight-sync extension
# extends it, so servers of that transport have it already.
ROUTES_EXTENSION = "megatron_rl.rollout.route_capture.RoutesWorkerExtension"


class RoutesError(EngineError):
    """The engine cannot return routes, or returned rows that do not fit the completion (the
    fleet treats it as that engine's fault: marked down, its requests re-sent)."""


def route_dtype(num_experts: int) -> np.dtype:
    """The narrowest integer type for expert ids below ``num_experts``."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


def resolve_source(source: str, cuda: bool) -> str:
    """``auto`` -> ``native`` with CUDA, ``capture`` without; ``native`` without CUDA is refused."""
    if source not in SOURCES:
        raise ValueError(f"rollout.routes_source must be one of {list(SOURCES)}, got {source!r}")
    if source == "auto":
        return "native" if cuda else "capture"
    if source == "native" and not cuda:
        raise RoutesError("rollout.routes_source=native: vLLM's enable_return_routed_experts needs Model "
                          "Runner V2, which needs a CUDA GPU (Triton); without one vLLM refuses it "
                          "('AuxOutput Connector requires Model Runner V2'). Use routes_source=capture "
                          "(or auto) on CPU")
    return source


@dataclasses.dataclass(frozen=True)
class RouteInfo:
    """What an engine said at start-up: the live source and the routing layers' shape."""

    source: str  # "native" | "capture"
    layers: tuple[int, ...]  # decoder-layer index of every MoE layer, in model order
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return route_dtype(self.num_experts)

    @classmethod
    def from_dict(cls, d: dict) -> "RouteInfo":
        return cls(source=str(d["source"]), layers=tuple(int(x) for x in d["layers"]), top_k=int(d["top_k"]),
                   num_experts=int(d["num_experts"]))

    def to_dict(self) -> dict:
        return {"source": self.source, "layers": list(self.layers), "top_k": self.top_k,
                "num_experts": self.num_experts}


def server_route_args(args: list[str], source: str) -> list[str]:
    """The vLLM server arguments that make it return routes by ``source`` (resolved), beside its
    other arguments ``args`` (an extension already there, the gloo sync's, extends ours)."""
    extra = [] if "--worker-extension-cls" in args else ["--worker-extension-cls", ROUTES_EXTENSION]
    if source == "native":
        extra.append("--enable-return-routed-experts")
    return extra


# ------------------------------------------------------------------------------- wire format
def pack(a: np.ndarray) -> dict:
    """An array as JSON-safe data (collective_rpc answers travel as JSON from a server)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def unpack(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def decode_npy_b64(s: str) -> np.ndarray:
    """vLLM's generate route's ``routed_experts``: base64 of ``.npy`` bytes."""
    import io

    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)


# ----------------------------------------------------------------------------- request ids
def request_names(internal_id: str) -> list[tuple[str, int | None]]:
    """The ``(external id, sample index)`` readings of vLLM's internal request id ``internal_id``
    (index None: a request of one sample).

    vLLM names sample ``j`` of an ``n > 1`` request ``"{j}_{external}"`` and appends ``"-<8 random
    characters>"`` to every request it admits (unless told not to), so ``"3_a-0f1e2d3c"`` is sample 3
    of ``"a"`` or the one sample of ``"3_a"``: the caller knows which it sent."""
    out = []
    for base in dict.fromkeys([re.sub(r"-[0-9A-Za-z]{8}$", "", internal_id), internal_id]):
        out.append((base, None))
        m = re.fullmatch(r"(\d+)_(.+)", base)
        if m is not None:
            out.append((m.group(2), int(m.group(1))))
    return out


def match_request(internal_id: str, wanted: dict[str, int]) -> tuple[str, int] | None:
    """``(external id, sample index)`` if ``internal_id`` is a sample of one of ``wanted``
    (external id -> its ``n``), else None."""
    for external, j in request_names(internal_id):
        n = wanted.get(external)
        if n is None:
            continue
        if n == 1 and j is None:
            return external, 0
        if n > 1 and j is not None and j < n:
            return external, j
    return None


# ---------------------------------------------------------------------------------- checks
def expected_rows(prompt_len: int, response_len: int) -> int:
    """Rows an engine returns for a completion: every position but the last token's."""
    return prompt_len + response_len - 1


def fit_rows(rows: np.ndarray, tokens: np.ndarray | None, prompt_ids: list[int], token_ids: list[int],
             info: RouteInfo, where: str) -> np.ndarray:
    """The ``[P + N - 1, L, k]`` routes of a completion from what the engine recorded for it.

    ``rows`` may hold more positions (tokens the front end dropped after a stop string); fewer is
    an error, and so is any position whose recorded input token (``tokens``, when known) is not the
    completion's token at that position: rows that do not belong to this completion."""
    need = expected_rows(len(prompt_ids), len(token_ids))
    if need <= 0:
        return np.zeros((0, len(info.layers), info.top_k), dtype=info.dtype)
    if rows.ndim != 3 or rows.shape[1:] != (len(info.layers), info.top_k):
        raise RoutesError(f"{where}: routes of shape {tuple(rows.shape)}, expected [positions, "
                          f"{len(info.layers)} MoE layers, top_k={info.top_k}]")
    if rows.shape[0] < need:
        raise RoutesError(f"{where}: {rows.shape[0]} rows of routes for a prompt of {len(prompt_ids)} and a "
                          f"response of {len(token_ids)} tokens (need {need})")
    if tokens is not None:
        seq = np.asarray(list(prompt_ids) + list(token_ids[:-1]), dtype=np.int64)
        got = np.asarray(tokens[:need], dtype=np.int64)
        bad = np.nonzero(got != seq)[0]
        if bad.size:
            p = int(bad[0])
            raise RoutesError(f"{where}: the routes' row {p} was computed on token {int(got[p])}, but the "
                              f"completion has token {int(seq[p])} there ({bad.size} of {need} rows differ)")
    out = rows[:need]
    if out.size and (int(out.min()) < 0 or int(out.max()) >= info.num_experts):
        raise RoutesError(f"{where}: expert ids outside [0, {info.num_experts})")
    return out.astype(info.dtype, copy=False)


def select_layers(rows: np.ndarray, info: RouteInfo) -> np.ndarray:
    """The MoE layers' columns of vLLM's native ``[positions, decoder layers, k]`` rows (dense
    layers carry zeros there)."""
    if rows.ndim != 3:
        raise RoutesError(f"routed_experts of shape {tuple(rows.shape)}, expected [positions, layers, top_k]")
    if rows.shape[1] == len(info.layers):
        return rows
    if rows.shape[1] <= max(info.layers, default=-1):
        raise RoutesError(f"routed_experts has {rows.shape[1]} layers; the MoE layers are {list(info.layers)}")
    return rows[:, list(info.layers)]


def pick_rows(entries: list[dict], prompt_ids: list[int], token_ids: list[int], info: RouteInfo,
              where: str) -> np.ndarray:
    """The completion's routes from the captured tracks of its request (``mrl_routes_take``
    entries; more than one when the same request id ran twice on the engine): the one whose rows
    were computed on the completion's tokens."""
    if not entries:
        raise RoutesError(f"{where}: the engine recorded no routes for it")
    errors = []
    for entry in entries:
        try:
            return fit_rows(unpack(entry["rows"]), unpack(entry["tokens"]), prompt_ids, token_ids, info, where)
        except RoutesError as exc:
            errors.append(str(exc))
    raise RoutesError(errors[0] if len(errors) == 1 else f"{where}: none of {len(errors)} recorded tracks "
                      f"fits: {errors}")


def aborted_or(finish_reason: str, fit, *args):
    """``fit(*args)`` (:func:`fit_rows` / :func:`pick_rows`); for an aborted completion (a hedged
    request's losing copy, a leftover: never trained on) rows it cannot have are None, not an error."""
    try:
        return fit(*args)
    except RoutesError:
        if finish_reason == "abort":
            return None
        raise
