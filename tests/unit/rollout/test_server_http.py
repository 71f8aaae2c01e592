"""The server handle's control plane over a real socket: a kept-alive connection that the server
closes under a request (uvicorn's idle close racing the client's reuse) costs an idempotent call
nothing and a state-changing one a clear EngineDied (it is not sent twice)."""
from __future__ import annotations

import socket
import threading

import pytest

from megatron_rl.rollout.base import EngineDied
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.server import KEEPALIVE_S, VLLMServer

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
