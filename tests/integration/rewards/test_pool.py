"""HardTimeoutPool lifecycle: workers killed from outside are replaced; a broken setup fails loudly."""

from __future__ import annotations

import os
import signal
import time

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
        with pytest.raises(RuntimeError, match="failed to start"):
            pool.run(TASKS[:1])
