"""RemoteEngine's process plumbing with light stand-in engines (no vLLM): start-up errors, replies,
timeouts and a dying child are all reported by engine name, never as a hang."""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.remote import EngineDied, EngineError, EngineTimeout, RemoteEngine

pytestmark = pytest.mark.slow


class _Stub:
    """Answers rpc calls like vLLM's collective_rpc: fn(worker, *args) per worker."""

    def __init__(self):
        self.llm, self.weight_version = self, 0

    def collective_rpc(self, fn, args=()):
        return [fn(self, *args)]

    def close(self):
        pass


def stub_factory(model_path, cfg, **kwargs):
    return _Stub()


def broken_factory(model_path, cfg, **kwargs):
    raise RuntimeError(f"cannot load {model_path}")


def echo(worker, value):
    return (value, os.getpid(), os.environ.get("RANK"), os.environ.get("MRL_MARK"))


def nap(worker, seconds):
    time.sleep(seconds)
    return seconds


def crash(worker, code):
    os._exit(code)


def _cfg():
    return RolloutConfig(kv_cache_bytes=0, timeout_s=30.0)


def test_start_failure_is_reported_with_the_child_traceback():
    with pytest.raises(EngineError, match=r"engine bad: 'start' failed(.|\n)*cannot load /nowhere"):
        RemoteEngine("/nowhere", _cfg(), name="bad", factory=broken_factory)


def test_replies_timeouts_and_death_name_the_engine(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # a torchrun variable: the engine must not inherit it
    engine = RemoteEngine("none", _cfg(), name="stub0", factory=stub_factory,
                          env={"MRL_MARK": "x"})
    try:
        value, pid, rank, mark = engine.rpc(echo, 7)[0]
        assert (value, pid, rank, mark) == (7, engine.pid, None, "x")
        assert pid != os.getpid()

        t0 = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"engine stub0: no reply to 'rpc' within 0.5s"):
            engine.rpc(nap, 3.0, timeout_s=0.5)
        assert time.monotonic() - t0 < 2.5
        # the late reply is drained before the next request, which then gets its own answer
        assert engine.rpc(echo, 8)[0][0] == 8

        t0 = time.monotonic()
        with pytest.raises(EngineDied, match=r"engine stub0 \(pid \d+\) died during 'rpc', exit code 3"):
            engine.rpc(crash, 3)
        assert time.monotonic() - t0 < 10 and not engine.alive
        with pytest.raises(EngineDied):
            engine.rpc(echo, 9)
    finally:
        engine.close()
