"""One vLLM server process, driven over HTTP: generation through vLLM's token-in / token-out route
(``/inference/v1/generate``, on with ``--enable-scale-out``), control through its RL and dev routes
(``VLLM_SERVER_DEV_MODE=1``).

Generation: one request per prompt, ``n`` samples out (the request and reply formats, the samples'
text decoded on the client: :mod:`megatron_rl.rollout.server_wire`; measured on the demo's wave, 512
samples x 12 tokens: the log-prob part of the server's detokenization alone 81 vs 25 ms of the
server's core; the client's decode 2 ms); MoE routes with them: :mod:`megatron_rl.rollout.server_routes`.

Scoring (the weight sync's probe): prompt log-probs from ``/v1/completions``.

Control: ``/health``, ``/pause?mode=`` and ``/resume``, ``/abort_requests``, ``/reset_prefix_cache``, ``/weight_info`` and
``/update_weight_version``, ``/sleep`` / ``/wake_up``, ``/collective_rpc``. Weights travel through
vLLM's weight-transfer routes (``/init_weight_transfer_engine`` ... ``/finish_weight_update``), driven
by the weight sync (``megatron_rl.sync.vllm_protocol``) with ``weight_sync_client()``.

Every call has a timeout; failures are raised as engine errors naming the server; the two HTTP
clients (``httpx`` for control, ``aiohttp`` for generation): :mod:`megatron_rl.rollout.server_http`.

Owns: :class:`VLLMServer`, the handle (its URL, clients, weight version, served model, routes info).
May call: :mod:`~megatron_rl.rollout.server_http`, :mod:`~megatron_rl.rollout.server_wire`,
:mod:`~megatron_rl.rollout.server_routes`, vLLM's weight-sync client.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import httpx

from megatron_rl.config.base import ConfigError
from megatron_rl.rollout.base import (Completion, EngineDied, EngineError, EngineTimeout, PauseMode,
                                      RolloutEngine, SamplingSpec)
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.routes import ROUTES_EXTENSION, RouteInfo, RoutesError
from megatron_rl.rollout.server_http import KEEPALIVE_S, RESEND_ON, control_client, post_json, raise_for_status
from megatron_rl.rollout.server_routes import reply_routes
from megatron_rl.rollout.server_wire import (BASE_VERSION, GENERATE, GENERATE_ID_PREFIX, completion_text,
                                             generate_body, parse_choices, version_of)


class VLLMServer(RolloutEngine):
    """A handle to one vLLM server at ``url`` (its process may be anywhere)."""

    def __init__(self, url: str, cfg: RolloutConfig, *, name: str | None = None,
                 model: str | None = None, workers: int | None = None, return_routes: bool = False,
                 tokenizer=None):
        """``return_routes``: completions carry their MoE routes (the server must run
        :data:`~megatron_rl.rollout.routes.ROUTES_EXTENSION`; :meth:`connect` installs it).
        ``tokenizer`` (the policy's): the server returns tokens only and this handle decodes the
        texts (:func:`completion_text`); None: the server detokenizes."""
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.name = name or self.url.split("://", 1)[-1]
        self.model = model  # served model name; asked from /v1/models when None
        # The longest prompt + response the server accepts (its --max-model-len, from /v1/models).
        self.max_model_len: int | None = None
        self._card_read = False
        # Ranks this engine takes in a weight-transfer group: one per vLLM worker (TP x PP).
        self.workers = workers or cfg.tensor_parallel_size
        self.weight_version = 0
        self._http = control_client(self.url, cfg.control_timeout_s)
        self._async: aiohttp.ClientSession | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self.return_routes = return_routes
        self.route_info: RouteInfo | None = None  # what the server said at connect
        self.tokenizer = tokenizer

    def retarget(self, url: str) -> None:
        """The server came back at another address (its launcher restarted it on a new port)."""
        url = url.rstrip("/")
        if url != self.url:
            self._http.close()
            self.url = url
            self._http = control_client(self.url, self.cfg.control_timeout_s)
            self._drop_async()

    def __repr__(self) -> str:
        return f"VLLMServer({self.name!r}, {self.url!r})"

    # ------------------------------------------------------------------------------ control plane
    def _call(self, method: str, path: str, *, timeout: float | None = None, **kwargs) -> httpx.Response:
        def send() -> httpx.Response:
            return self._http.request(method, path, timeout=timeout or self.cfg.control_timeout_s, **kwargs)

        try:
            try:
                resp = send()
            except RESEND_ON:
                if method != "GET":
                    raise
                resp = send()
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"engine {self.name} ({self.url}): no answer to {method} {path} within "
                                f"{timeout or self.cfg.control_timeout_s:.1f}s") from exc
        except httpx.TransportError as exc:
            raise EngineDied(f"engine {self.name} ({self.url}): {method} {path} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
        raise_for_status(resp, f"engine {self.name} ({self.url}): {method} {path} ->")
        return resp

    def health(self, timeout: float | None = None) -> bool:
        try:
            self._call("GET", "/health", timeout=timeout)
        except EngineError:
            return False
        return True

    def connect(self, timeout: float | None = None) -> "VLLMServer":
        """Check the server answers, learn the model it serves and the weight version it reports
        (the version this handle starts from; the trainer's first sync sets and verifies it)."""
        self._call("GET", "/health", timeout=timeout)
        self.served_model()
        self.weight_version = version_of(self.server_weight_version(), self.weight_version)
        if self.return_routes:
            self.route_info = self.install_routes()
        return self

    def install_routes(self) -> RouteInfo:
        """Ask the server's workers for their routes (binding the capture hook unless vLLM's own
        routed-experts output is on): a server started without the routes extension is refused."""
        try:
            answer = self.collective_rpc("mrl_routes_install")
        except EngineError as exc:
            raise RoutesError(f"engine {self.name} ({self.url}) cannot return MoE routes: start it with "
                              f"--worker-extension-cls {ROUTES_EXTENSION} (or an extension of it, e.g. the gloo "
                              f"sync's; and --enable-return-routed-experts on GPUs): {exc}") from exc
        if not answer:
            raise RoutesError(f"engine {self.name} ({self.url}): mrl_routes_install answered nothing")
        info = RouteInfo.from_dict(answer[0])
        want = self.cfg.routes_source
        if want != "auto" and info.source != want:
            raise RoutesError(f"engine {self.name} ({self.url}) returns routes by {info.source!r}, but "
                              f"rollout.routes_source={want!r}" + (
                                  " (start it with --enable-return-routed-experts)" if want == "native" else
                                  " (start it without --enable-return-routed-experts)"))
        return info

    def served_model(self, timeout: float | None = None) -> str:
        """The served model's name (and its max model length, kept in ``max_model_len``); asked
        once, at :meth:`connect`."""
        if self._card_read:
            return self.model
        data = self._call("GET", "/v1/models", timeout=timeout).json().get("data") or []
        if not data:
            raise EngineError(f"engine {self.name} ({self.url}) serves no model")
        card = next((c for c in data if c.get("id") == self.model), data[0])
        self.model = card["id"]
        limit = card.get("max_model_len")
        self.max_model_len = limit if isinstance(limit, int) else None
        self._card_read = True
        return self.model

    def require_model_len(self, need: int, key: str) -> None:
        """Refuse a server that cannot hold the run's longest prompt + response (``need`` tokens);
        ``key`` names the config setting the server comes from. Call after :meth:`served_model`."""
        if self.max_model_len is not None and self.max_model_len < need:
            raise ConfigError(key, f"engine {self.name} ({self.url}) serves max_model_len={self.max_model_len}, "
                                   f"but the run samples up to {need} tokens (rollout.max_prompt_len + the "
                                   f"longest stages[].max_response_len / rollout.eval_max_tokens): start it "
                                   f"with --max-model-len >= {need}")

    def server_weight_version(self) -> str | None:
        """What the server itself says its weight version is (``/weight_info``; ``"0"`` for the
        weights it started with)."""
        label = self._call("GET", "/weight_info").json().get("weight_version")
        return "0" if label == BASE_VERSION else label

    def set_weight_version(self, version: int) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        self.weight_version = version

    def reset_prefix_cache(self) -> None:
        """Drop every cached block, including those of requests running (or frozen by a ``keep``
        pause): they are preempted and recomputed with the current weights when they run again."""
        ok = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}).json()
        if not ok.get("success", True):
            raise EngineError(f"engine {self.name} ({self.url}): /reset_prefix_cache refused (blocks still held)")

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (ids given with ``submit``); they answer at once with the tokens they
        have and finish reason ``abort``. Unknown (finished) ids are ignored. Awaitable (the fleet's
        loop aborts a hedged request's losing copy while it dispatches); within
        ``rollout.control_timeout_s``, else :class:`EngineTimeout`."""
        if not request_ids:
            return
        ids = [GENERATE_ID_PREFIX + rid for rid in request_ids]
        where, limit = f"engine {self.name} ({self.url}): POST /abort_requests", self.cfg.control_timeout_s
        try:
            await asyncio.wait_for(post_json(self._client(), "/abort_requests", {"request_ids": ids}, where),
                                   limit)
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"{where}: no answer within {limit:.1f}s") from exc

    def pause(self, mode: PauseMode = "keep") -> None:
        # clear_cache only applies to abort / wait; "keep" keeps the cache for the frozen requests.
        self._call("POST", "/pause", params={"mode": mode, "clear_cache": "false"},
                   timeout=self.cfg.timeout_s if mode == "wait" else None)

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json().get("is_paused"))

    def sleep(self) -> None:
        self._call("POST", "/sleep", params={"level": 1})

    def wake_up(self) -> None:
        self._call("POST", "/wake_up")

    def collective_rpc(self, method: str, args: list | tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """``method`` on every vLLM worker of this server; one result per worker."""
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        return self._call("POST", "/collective_rpc", json=body, timeout=timeout).json().get("results", [])

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[1:]`` at T = 1 (the weight sync's probe): the
        prompt log-probs of vLLM's completions route."""
        body = {"model": self.served_model(), "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        reply = self._call("POST", "/v1/completions", json=body, timeout=self.cfg.timeout_s).json()
        try:
            scored = reply["choices"][0]["prompt_logprobs"][1:]
            return [float(d[str(t)]["logprob"]) for t, d in zip(token_ids[1:], scored, strict=True)]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"engine {self.name} ({self.url}): no prompt log-probs for the probe in "
                              f"{str(reply)[:300]}") from exc

    def weight_sync_client(self, timeout_s: float):
        """vLLM's own trainer-side client of this server's weight-transfer routes."""
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(self.url, timeout=timeout_s)

    # ------------------------------------------------------------------------------- generation
    def _client(self) -> aiohttp.ClientSession:
        """The generation client of the running event loop (one per loop; idle connections dropped
        after :data:`KEEPALIVE_S`, under the server's own idle close)."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._drop_async()
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._async = aiohttp.ClientSession(self.url, connector=connector, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.cfg.control_timeout_s))
            self._async_loop = loop
        return self._async

    def _drop_async(self) -> None:
        """Forget the generation client (closed on its own loop when that loop still runs)."""
        session, loop = self._async, self._async_loop
        self._async, self._async_loop = None, None
        if session is not None and loop is not None and loop.is_running() and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: loop.create_task(session.close()))

    async def submit(self, prompt_ids: list[int], sampling: SamplingSpec,
                     request_id: str | None = None) -> list[Completion]:
        """``sampling.n`` samples of one prompt; each carries the weight versions its tokens were
        sampled with (vLLM's weight-version spans: ``version_spans`` when weights changed mid-request)."""
        if self.route_info is not None and self.route_info.source == "capture" and request_id is None:
            request_id = f"mrl-routes-{uuid.uuid4().hex}"  # the name its routes are taken by
        body = generate_body(prompt_ids, sampling, request_id, text=self.tokenizer is None)
        version = self.weight_version
        where = f"engine {self.name} ({self.url})"
        try:
            reply = await asyncio.wait_for(
                post_json(self._client(), GENERATE, body, f"{where}: generation request"), self.cfg.timeout_s)
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"{where}: no answer to a generation request within rollout.timeout_s="
                                f"{self.cfg.timeout_s:g}s") from exc
        choices = parse_choices(reply, sampling.n, where)
        routes = await reply_routes(self.route_info, choices, prompt_ids, request_id, sampling.n,
                                    session=self._client(), where=where, limit=self.cfg.control_timeout_s)
        out = []
        for c, rows in zip(choices, routes):
            spans = [(version_of(sp["version"], version), sp["start"], sp["end"]) for sp in c["spans"]
                     if sp["end"] > sp["start"]]
            text = c["text"] if self.tokenizer is None else completion_text(
                self.tokenizer, prompt_ids, c["token_ids"], c["finish_reason"])
            out.append(Completion(token_ids=c["token_ids"], logprobs=c["logprobs"], text=text,
                                  finish_reason=c["finish_reason"], truncated=c["finish_reason"] == "length",
                                  weight_version=spans[0][0] if spans else version,
                                  version_spans=spans if len({v for v, _, _ in spans}) > 1 else [],
                                  engine=self.name, routes=rows))
        return out

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        async def run():
            try:
                return await asyncio.gather(*(self.submit(p, sampling.for_prompt(i))
                                              for i, p in enumerate(prompt_ids)))
            finally:
                await self.aclose()
        return list(asyncio.run(run()))

    async def aclose(self) -> None:
        if self._async is not None:
            client, self._async, self._async_loop = self._async, None, None
            await client.close()

    def close(self) -> None:
        self._http.close()
