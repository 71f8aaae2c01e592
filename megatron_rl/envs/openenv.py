"""Environments served by OpenEnv environment servers (``envs.services``), driven over their protocol.

OpenEnv (``openenv-core``, the environment servers TRL trains against) serves a Gym-like environment
over HTTP: one episode is one WebSocket session at ``{url}/ws`` (``{"type": "reset", "data": {...}}``,
``{"type": "step", "data": <action>}``, ``{"type": "close"}``; each answered ``{"type":
"observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or ``{"type": "error",
...}``), with ``GET /health`` and ``GET /schema`` (the Action's and Observation's JSON schemas) beside
it. The trainer keeps the model: tokens in, tokens out as for any environment. Each model turn's text
becomes the Action's ``action_field``; the Observation's ``observation_field`` (or all its fields, as
JSON) is what the model reads next; ``done`` ends the trajectory, whose last turn the data's reward
style scores.

Only the protocol is spoken here (a WebSocket client, ``websockets``): the server runs wherever its
own package and environment are installed. Faults are per episode: every connect and every answer
waits at most ``timeout_s``; a failed call is retried (``retries``: reconnect, reset with the
episode's seed, replay its actions, checking the server answers as before, then the call again);
past them the episode ends as a failed tool call (``env/tool_errors``, ``env/tool_timeouts``),
logged once per service per ``_LOG_EVERY_S``. A dead or slow server never stops the run; one that
does not answer at start-up does (:func:`check_service`, one line naming the key).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
import zlib
from typing import ClassVar
from urllib.parse import urlparse

from megatron_rl.common.errors import InputError
from megatron_rl.envs.base import Environment, StepResult, cut_text
from megatron_rl.envs.config import OpenEnvServiceConfig
from megatron_rl.envs.tools import ERROR, TIMEOUT

log = logging.getLogger("megatron_rl")

# The row's extra_info key whose mapping is sent with the episode's reset (the task the prompt poses).
RESET_KEY = "env_kwargs"
# The least time between two log lines about one service's failed episodes.
_LOG_EVERY_S = 10.0
# Server error codes worth a new session (the others are the environment's own failure).
_RETRYABLE = ("CAPACITY_REACHED", "SESSION_ERROR", "FACTORY_ERROR")


class EnvServiceError(InputError):
    """A configured environment server does not answer at start-up, or its schema does not fit."""


class CallFailed(Exception):
    """One call to the server failed; ``timeout`` when it did not answer in time, ``retry`` when
    another session may succeed."""

    def __init__(self, message: str, *, timeout: bool = False, retry: bool = True):
        super().__init__(message)
        self.timeout, self.retry = timeout, retry


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class Session:
    """One episode on the server: reset, then steps; reconnects and replays on a failure."""

    def __init__(self, cfg: OpenEnvServiceConfig, reset_data: dict):
        self.cfg = cfg
        self.reset_data = reset_data
        self.ws_url = "ws" + cfg.url.rstrip("/")[4:] + "/ws"  # http(s):// -> ws(s)://
        self._ws = None
        self._history: list[tuple[dict, dict]] = []  # (message, the server's answer) so far

    def call(self, message: dict) -> dict:
        """The server's answer (``data``) to ``message``, after up to ``retries`` new sessions."""
        failure: CallFailed | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(min(0.25 * 2 ** (attempt - 1), 2.0))
            try:
                if self._ws is None:
                    self._open()
                answer = self._exchange(message)
                self._history.append((message, answer))
                return answer
            except CallFailed as exc:
                failure = exc
                self.close()
                if not exc.retry:
                    break
        assert failure is not None
        raise failure

    def _open(self) -> None:
        """A new session: connect, and replay the episode so far (the same answers expected)."""
        from websockets.sync.client import connect

        try:
            self._ws = connect(self.ws_url, open_timeout=self.cfg.timeout_s, close_timeout=1.0,
                               max_size=16 << 20, ping_interval=None,
                               **({"proxy": None} if _is_loopback(self.ws_url) else {}))
        except TimeoutError:
            raise CallFailed(f"no connection to {self.ws_url} within {self.cfg.timeout_s:g} s", timeout=True) from None
        except Exception as exc:  # noqa: BLE001 - refused, reset, DNS, handshake: the server is not there
            raise CallFailed(f"cannot connect to {self.ws_url}: {type(exc).__name__}: {exc}") from None
        for message, answer in self._history:
            if self._exchange(message) != answer:
                raise CallFailed("the episode replayed on a new session answered differently (the environment "
                                 "is not deterministic given its seed and actions)", retry=False)

    def _exchange(self, message: dict) -> dict:
        try:
            self._ws.send(json.dumps(message))
            raw = self._ws.recv(timeout=self.cfg.timeout_s)
        except TimeoutError:
            raise CallFailed(f"no answer to {message['type']} within {self.cfg.timeout_s:g} s", timeout=True) from None
        except Exception as exc:  # noqa: BLE001 - the connection broke (the server died or closed it)
            raise CallFailed(f"the connection broke on {message['type']}: {type(exc).__name__}: {exc}") from None
        try:
            reply = json.loads(raw)
            kind, data = reply["type"], reply.get("data") or {}
        except (ValueError, TypeError, KeyError):
            raise CallFailed(f"not an OpenEnv answer: {str(raw)[:200]!r}", retry=False) from None
        if kind == "error":
            code = str(data.get("code", ""))
            raise CallFailed(f"the server answered {code or 'an error'}: {str(data.get('message', ''))[:300]}",
                             retry=code in _RETRYABLE)
        if kind != "observation" or not isinstance(data.get("observation"), dict):
            raise CallFailed(f"not an observation: {str(raw)[:200]!r}", retry=False)
        return data

    def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.send(json.dumps({"type": "close"}))
            except Exception:  # noqa: BLE001 - best effort: the server may be gone
                pass
            try:
                ws.close()
            except Exception:  # noqa: BLE001
                pass


class _FailureLog:
    """Failed episodes of one service, logged at most once per _LOG_EVERY_S (with the count)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def add(self, service: str, reason: str) -> None:
        with self._lock:
            self._count[service] = self._count.get(service, 0) + 1
            now = time.monotonic()
            if now - self._last.get(service, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._last[service], n = now, self._count.pop(service)
        log.warning("environment service %s: %d episode(s) failed and ended as counted tool errors; last: %s",
                    service, n, reason)


FAILURES = _FailureLog()


class OpenEnvEnvironment(Environment):
    """An episode on an OpenEnv server; :func:`service_class` binds a configured service."""

    service: ClassVar[OpenEnvServiceConfig]

    def reset(self, record) -> list[int]:
        ids = super().reset(record)
        episode = f"{record.uid or record.row}:{uuid.uuid4().hex[:12]}"
        kwargs = (getattr(record, "extra", None) or {}).get(RESET_KEY) or {}
        data = {**(kwargs if isinstance(kwargs, dict) else {}), "seed": zlib.crc32(episode.encode()),
                "episode_id": episode[:255]}
        self.session = Session(self.service, data)
        self._started = False
        return ids  # nothing is sent yet: the first step opens the session (on a worker thread)

    def step(self, turn: str) -> StepResult:
        self.calls += 1
        try:
            if not self._started:
                self.session.call({"type": "reset", "data": self.session.reset_data})
                self._started = True
            answer = self.session.call({"type": "step", "data": {self.service.action_field: turn}})
        except CallFailed as exc:
            self.session.close()
            FAILURES.add(self.name, str(exc))
            return StepResult(done=True, tool=self.name, error=TIMEOUT if exc.timeout else ERROR)
        if answer.get("done"):
            self.session.close()
            return StepResult(done=True, tool=self.name)
        text, cut = cut_text(observation_text(answer["observation"], self.service.observation_field),
                             self.cfg.max_observation_chars)
        return StepResult(observation=text, tool=self.name, cut=cut)

    def __del__(self):  # an episode ended by the rollout (max_turns, length) frees its session too
        session = getattr(self, "session", None)
        if session is not None:
            session.close()


def observation_text(observation: dict, field: str) -> str:
    """What the model reads of an Observation: its ``field`` (text as it is), or all of it as JSON."""
    value = observation.get(field) if field else observation
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


_CLASSES: dict[tuple, type] = {}


def service_class(name: str, cfg: OpenEnvServiceConfig) -> type:
    """The environment class of service ``name`` (one per name and settings: registering it again
    is a no-op)."""
    key = (name, json.dumps(cfg.to_dict(), sort_keys=True))
    if key not in _CLASSES:
        _CLASSES[key] = type(f"OpenEnv[{name}]", (OpenEnvEnvironment,), {"service": cfg, "name": name,
                                                                          "__module__": __name__})
    return _CLASSES[key]


def _get_json(url: str, timeout_s: float):
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - the configured server
        return json.loads(resp.read().decode("utf-8"))


def check_service(name: str, cfg: OpenEnvServiceConfig) -> None:
    """Start-up: the server answers ``/health`` and its ``/schema`` has the configured fields (else
    every episode would fail); EnvServiceError naming the key otherwise."""
    key, base = f"envs.services.{name}", cfg.url.rstrip("/")
    try:
        _get_json(f"{base}/health", cfg.timeout_s)
        schema = _get_json(f"{base}/schema", cfg.timeout_s)
    except (OSError, ValueError, urllib.error.URLError) as exc:
        raise EnvServiceError(f"{key}.url: no OpenEnv environment server answers at {base} ({exc})") from None
    for field, part in ((cfg.action_field, "action"), (cfg.observation_field, "observation")):
        fields = sorted(((schema.get(part) or {}).get("properties") or {}))
        if field and field not in fields:
            raise EnvServiceError(f"{key}.{part}_field: the server's {part} has no field {field!r} (its "
                                  f"fields: {fields})")
