"""The HTTP layer under a vLLM server handle (:mod:`megatron_rl.rollout.server`): its two clients and
how their failures become engine errors.

Every call has a timeout; failures are raised as :class:`~megatron_rl.rollout.base.EngineDied`
(connection refused or cut), :class:`~megatron_rl.rollout.base.EngineTimeout` or
:class:`~megatron_rl.rollout.base.EngineError` (the server answered with an error;
:class:`RequestRejected` when it refused the request itself, HTTP 4xx), naming the server.

Two HTTP clients: control calls go through ``httpx`` (synchronous, from any thread); generation and
aborts, which the fleet sends from its event loop a wave at a time (a request per prompt), through
``aiohttp`` (vLLM's own dependency), whose client costs about a ninth of ``httpx``'s per request: on a
small CPU machine the client shares a core with the trainer or the server (measured on one core, 64
concurrent requests of the demo's shape: 21 vs 180 ms of client CPU per wave).

Owns: the clients' settings (:data:`KEEPALIVE_S`), the error mapping.
May call: ``httpx``, ``aiohttp``.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx

from megatron_rl.rollout.base import EngineDied, EngineError


def server_healthy(url: str, timeout_s: float = 5.0) -> bool:
    """The server at ``url`` answers ``/health`` with 200."""
    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class RequestRejected(EngineError):
    """The server refused the request itself (HTTP 4xx): resending it elsewhere would not help."""


def raise_for_status(resp: httpx.Response, where: str) -> None:
    """An error answer as :class:`RequestRejected` (4xx: the request itself) or :class:`EngineError`."""
    if resp.status_code >= 400:
        raise_status(resp.status_code, resp.text, where)


def raise_status(status: int, text: str, where: str) -> None:
    kind = RequestRejected if status < 500 else EngineError
    raise kind(f"{where} HTTP {status}: {text[:500]}")


async def post_json(session: aiohttp.ClientSession, path: str, body: dict, where: str):
    """POST ``body``; the reply's JSON. An error answer is raised as in :func:`raise_for_status`;
    a refused or cut connection as :class:`EngineDied` (timeouts are the caller's ``wait_for``)."""
    try:
        async with session.post(path, json=body) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise_status(resp.status, raw.decode(errors="replace"), f"{where} ->")
    except aiohttp.ClientError as exc:  # connection refused, reset, cut mid-answer (not timeouts)
        if isinstance(exc, asyncio.TimeoutError):
            raise
        raise EngineDied(f"{where} failed: {type(exc).__name__}: {exc}") from exc
    return json.loads(raw) if raw else {}


# How long an idle kept-alive connection is reused: under the server's own idle close (uvicorn's
# keep-alive timeout, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default). At httpx's default (also 5 s) a
# request could go out on a connection the server was closing that instant and come back as
# "Server disconnected without sending a response": seen in CI as a spurious failed sync of a
# healthy server.
KEEPALIVE_S = 2.0
# Idempotent control calls (GET) are sent once more when a kept-alive connection was closed under
# them before any answer (the request never reached the server's handler).
RESEND_ON = (httpx.RemoteProtocolError,)


def control_client(url: str, timeout_s: float) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
