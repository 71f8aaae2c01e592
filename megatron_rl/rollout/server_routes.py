"""The MoE routes of a vLLM server's generate reply (routing replay, :mod:`megatron_rl.rollout.routes`):
from the reply itself (vLLM's own ``routed_experts``, ``native``: GPUs) or taken from the workers'
capture (``mrl_routes_take`` through ``/collective_rpc``, ``capture``: the CPU), each sample's rows
checked against its prompt and tokens. A sample the server aborted may come without routes.

Owns: nothing (a function of one reply).
May call: :mod:`megatron_rl.rollout.routes` (decode, fit, pick, checks), the server's
``/collective_rpc`` route through the handle's generation client.
"""

from __future__ import annotations

import asyncio

import aiohttp

from megatron_rl.rollout.base import EngineTimeout
from megatron_rl.rollout.routes import RouteInfo, RoutesError, aborted_or, decode_npy_b64, fit_rows, pick_rows, select_layers
from megatron_rl.rollout.server_http import post_json
from megatron_rl.rollout.server_wire import GENERATE_ID_PREFIX


async def reply_routes(info: RouteInfo | None, choices: list[dict], prompt_ids: list[int], request_id: str | None,
                       n: int, *, session: aiohttp.ClientSession, where: str, limit: float) -> list:
    """Each choice's MoE routes (None each without ``info``: the server returns none); ``where``
    names the server in errors, ``limit`` bounds the take (``rollout.control_timeout_s``)."""
    if info is None:
        return [None] * len(choices)
    where = f"{where}: request {request_id}"
    if info.source == "native":
        out = []
        for j, c in enumerate(choices):
            if not c["routed_experts"] and c["finish_reason"] == "abort":
                out.append(None)
                continue
            if not c["routed_experts"]:
                raise RoutesError(f"{where} sample {j}: no routed_experts in the reply (is the server "
                                  f"started with --enable-return-routed-experts?)")
            rows = select_layers(decode_npy_b64(c["routed_experts"]), info)
            out.append(aborted_or(c["finish_reason"], fit_rows, rows, None, prompt_ids, c["token_ids"], info,
                                  f"{where} sample {j}"))
        return out
    external = GENERATE_ID_PREFIX + request_id
    body = {"method": "mrl_routes_take", "args": [[[external, n]]], "kwargs": {}}
    try:
        reply = await asyncio.wait_for(
            post_json(session, "/collective_rpc", body, f"{where}: POST /collective_rpc mrl_routes_take"), limit)
    except asyncio.TimeoutError as exc:
        raise EngineTimeout(f"{where}: no routes within rollout.control_timeout_s={limit:g}s") from exc
    taken: dict = {}
    for answer in reply.get("results") or []:
        for entry in (answer or {}).values():
            taken.setdefault(int(entry["index"]), []).append(entry)
    return [aborted_or(c["finish_reason"], pick_rows, taken.get(j, []), prompt_ids, c["token_ids"], info,
                       f"{where} sample {j}") for j, c in enumerate(choices)]
