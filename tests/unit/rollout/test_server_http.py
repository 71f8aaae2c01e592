"""The server handle's control plane over a real socket: a kept-alive connection that the server
closes under a request (uvicorn's idle close racing the client's reuse) costs an idempotent call
nothing and a state-changing one a clear EngineDied (it is not sent twice)."""
from __future__ import annotations

import socket
import threading

import pytest

from megatron_rl.rollout.base import EngineDied
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.server import VLLMServer
from megatron_rl.rollout.server_http import KEEPALIVE_S

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class DropsFirstRequest:
    """A one-thread HTTP/1.1 server: it reads the first request of its first connection and closes
    that connection without an answer; every later request gets 200 {}."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        first = True
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                try:
                    while True:
                        head = b""
                        while b"\r\n\r\n" not in head:
                            chunk = conn.recv(4096)
                            if not chunk:
                                raise ConnectionError
                            head += chunk
                        self.requests.append(head.split(b"\r\n", 1)[0])
                        if first:
                            first = False
                            break  # closed under the request
                        conn.sendall(OK)
                except (ConnectionError, OSError):
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server():
    s = DropsFirstRequest()
    yield s
    s.close()


def _handle(url: str) -> VLLMServer:
    return VLLMServer(url, RolloutConfig(engine="vllm_server", control_timeout_s=5.0), name="e0", model="m")


def test_server_handle_resends_a_get_whose_connection_was_closed_under_it(server):
    engine = _handle(server.url)
    assert engine._call("GET", "/weight_info").json() == {}
    assert [r.split(b" ")[:2] for r in server.requests] == [[b"GET", b"/weight_info"]] * 2


def test_server_handle_does_not_resend_a_post_whose_connection_was_closed(server):
    engine = _handle(server.url)
    with pytest.raises(EngineDied, match=r"e0 .*POST /pause failed: RemoteProtocolError"):
        engine._call("POST", "/pause")
    assert len(server.requests) == 1


def test_server_handle_drops_idle_connections_before_vllms_keepalive_closes_them():
    import importlib.util
    import re
    from pathlib import Path

    # vLLM's default idle close, read from its source (importing vllm costs ~5 s)
    envs = Path(importlib.util.find_spec("vllm").origin).with_name("envs.py").read_text()
    server_keepalive = int(re.search(r"VLLM_HTTP_TIMEOUT_KEEP_ALIVE: int = (\d+)", envs).group(1))
    assert KEEPALIVE_S < server_keepalive
    engine = _handle("http://127.0.0.1:9")
    assert engine._http._transport._pool._keepalive_expiry == KEEPALIVE_S


class Generates:
    """An HTTP server that answers the generate route like vLLM (n choices with token ids, log-probs
    and weight-version spans), 400 / 500 on request, or not at all (a hang)."""

    def __init__(self, status: int = 200, hang: bool = False):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.bodies: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append({"path": self.path, **body})
                if hang:
                    threading.Event().wait(10)
                    return
                n = body.get("sampling_params", {}).get("n", 1)
                choices = [{"index": i, "token_ids": [5, 6 + i], "text": f"t{i}", "finish_reason": "length",
                            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0 - i}]},
                            "weight_versions": [{"version": "3", "start": 0, "end": 2}]} for i in range(n)]
                data = json.dumps({"choices": choices} if status == 200 else {"error": "no"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def test_generation_client_parses_answers_and_names_failures():
    """The generation client (aiohttp): samples in order with their log-probs and weight version;
    a 4xx answer is RequestRejected, a 5xx EngineError, a refused connection EngineDied, a hang
    EngineTimeout within rollout.timeout_s; aborts go to /abort_requests with vLLM's request names."""
    import asyncio

    from megatron_rl.rollout.base import EngineError, EngineTimeout, SamplingSpec
    from megatron_rl.rollout.server_http import RequestRejected
    from megatron_rl.rollout.server_wire import GENERATE

    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=2, seed=7)
    ok = Generates()
    try:
        engine = _handle(ok.url)
        groups = engine.generate([[1, 2], [3]], spec)
        assert [[c.token_ids for c in g] for g in groups] == [[[5, 6], [5, 7], [5, 8]]] * 2
        assert groups[0][2].logprobs == [-0.5, -3.0] and groups[0][0].weight_version == 3
        # the prompts are sent concurrently: the server may see them in either order
        sent = sorted((b["token_ids"], b["sampling_params"]["seed"], b["path"]) for b in ok.bodies)
        assert sent == [([1, 2], 7, GENERATE), ([3], 8, GENERATE)]  # prompt i: seed + i
        asyncio.run(engine.abort(["r1"]))
        assert ok.bodies[-1] == {"path": "/abort_requests", "request_ids": ["generate-tokens-r1"]}
    finally:
        ok.close()
    for status, kind in ((400, RequestRejected), (500, EngineError)):
        bad = Generates(status=status)
        try:
            with pytest.raises(kind, match=f"engine e0 .*generation request -> HTTP {status}"):
                _handle(bad.url).generate([[1]], spec)
        finally:
            bad.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(EngineDied, match="generation request failed"):
        _handle(refused).generate([[1]], spec)
    hang = Generates(hang=True)
    try:
        engine = VLLMServer(hang.url, RolloutConfig(engine="vllm_server", timeout_s=0.5), name="e0", model="m")
        with pytest.raises(EngineTimeout, match="within rollout.timeout_s=0.5s"):
            engine.generate([[1]], spec)
    finally:
        hang.close()
