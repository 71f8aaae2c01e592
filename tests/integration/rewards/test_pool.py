"""HardTimeoutPool lifecycle: workers killed from outside are replaced; a broken setup fails loudly,
quoting the worker's own error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_rl.rewards import RewardItem
from megatron_rl.rewards.math import exact_boxed
from megatron_rl.rewards.pool import HardTimeoutPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TASKS = [(exact_boxed, (RewardItem(f"\\boxed{{{i}}}", str(i % 2), "exact_boxed"),), 30.0)
         for i in range(4)]


def test_workers_killed_between_runs_are_replaced():
    with HardTimeoutPool(2, preload=("megatron_rl.rewards.math",)) as pool:
        first = pool.run(TASKS)
        for w in pool._workers:  # the OOM killer, or an operator, between two steps
            os.kill(w.proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        second = pool.run(TASKS)
    want = [1.0 if i % 2 == i else 0.0 for i in range(4)]
    assert [r.value.score for r in first] == [r.value.score for r in second] == want
    assert pool.restarts >= 1


def test_broken_worker_setup_raises_after_retries():
    with HardTimeoutPool(1, preload=("megatron_rl_no_such_module",)) as pool:
        with pytest.raises(RuntimeError, match="failed to start") as err:
            pool.run(TASKS[:1])
    # the worker's own traceback, not just its exit code
    assert "ModuleNotFoundError: No module named 'megatron_rl_no_such_module'" in str(err.value)


def test_launcher_without_main_guard_shows_the_workers_error(tmp_path):
    """A user's launcher without ``if __name__ == "__main__":`` (spawned workers re-run it)."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent("""
        from megatron_rl.rewards import RewardItem
        from megatron_rl.rewards.math import exact_boxed
        from megatron_rl.rewards.pool import HardTimeoutPool

        with HardTimeoutPool(1, preload=("megatron_rl.rewards.math",)) as pool:
            pool.run([(exact_boxed, (RewardItem("\\boxed{1}", "1", "exact_boxed"),), 30.0)])
    """))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=150)
    assert proc.returncode != 0
    # the launcher's own exception (the last one printed) carries the worker's error
    final = proc.stderr[proc.stderr.rindex("RuntimeError: reward worker failed to start"):]
    assert "bootstrapping phase" in final and "__main__" in final, final
