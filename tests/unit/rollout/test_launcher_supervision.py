"""The engine launcher's supervision on stand-in servers (tests/unit/rollout/fake_api_server.py:
plain processes that answer /health and, on SIGTERM, stop accepting connections but never exit, as
vLLM's API server does): a server that exited and one that is alive but refuses connections are both
killed (their whole process group) and restarted together, then re-registered; a stopped one (SIGSTOP,
still accepting connections) is left alone. The real vLLM servers' case is in
tests/integration/rollout/test_fleet.py."""

from __future__ import annotations

import os
import signal
import sys
import time

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.launcher import EngineLauncher, ServerSpec
from megatron_rl.rollout.registry import EngineRegistry
from megatron_rl.rollout.server_http import server_healthy
from tests.procs import live_in_group, wait_groups_gone


class FakeSpec(ServerSpec):
    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.unit.rollout.fake_api_server", "--host", self.host,
                "--port", str(self.port)]


def test_launcher_restarts_servers_that_exit_or_refuse_connections_and_spares_a_stopped_one(tmp_path):
    specs = [FakeSpec(name=f"n-{i}", model="m", host="127.0.0.1", rollout=RolloutConfig(), max_model_len=16,
                      log_path=str(tmp_path / f"n-{i}.log")) for i in range(3)]
    registry = EngineRegistry(tmp_path / "engines")
    launcher = EngineLauncher(specs, registry=registry, start_timeout_s=30.0, poll_s=0.1)
    seen: set[int] = set()
    try:
        launcher.start()
        old = [s.pid for s in launcher.servers]
        seen.update(old)
        assert sorted(registry.records()) == ["n-0", "n-1", "n-2"]
        assert all(len(live_in_group(pid)) == 2 for pid in old)  # each with its helper
        launcher.supervise_in_background()
        os.killpg(old[0], signal.SIGTERM)  # terminating: refuses connections, never exits
        os.killpg(old[1], signal.SIGKILL)  # exited
        os.killpg(old[2], signal.SIGSTOP)  # hung: still accepts connections
        deadline = time.monotonic() + 20
        while True:
            recs = registry.records()
            if all(n in recs and recs[n].pid != p for n, p in (("n-0", old[0]), ("n-1", old[1]))):
                break
            assert time.monotonic() < deadline, (recs, launcher.restarts)
            time.sleep(0.05)
        seen.update(s.pid for s in launcher.servers)
        assert all(server_healthy(recs[n].url) for n in ("n-0", "n-1"))
        assert launcher.restarts == 2 and recs["n-2"].pid == old[2]  # the stopped one is left alone
        waited, alive = wait_groups_gone(old[:2], timeout_s=5)
        assert not alive, alive  # the terminating server's whole group was killed, helper included
    finally:
        for pid in seen:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        launcher.stop(grace_s=0.5)
        for pid in seen:
            if live_in_group(pid):
                os.killpg(pid, signal.SIGKILL)
