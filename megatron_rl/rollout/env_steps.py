"""Environment steps of multi-turn trajectories: run on a few daemon threads, each round's steps
bounded together by ``envs.wait_s``.

A step that does not answer in time becomes a timeout observation (the tool's error ``timeout``);
one that raises ends its episode (counted as a tool error). An environment stuck in a step cannot
keep the process from exiting (the workers are daemon threads).

Owns: the step workers.
May call: the environments' ``step`` (nothing else).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from typing import Callable

from megatron_rl.envs.base import StepResult
from megatron_rl.envs.tools import TIMEOUT
from megatron_rl.rollout.trajectory import Trajectory

log = logging.getLogger("megatron_rl")


def step_all(stepping: list[Trajectory], workers: "StepWorkers", deadline: float, wait_s: float,
             apply: Callable[[Trajectory, StepResult], None]) -> None:
    """Step every trajectory's environment on its last turn's text, all at once, until ``deadline``
    (``time.monotonic()``; ``wait_s`` after the round began); ``apply(trajectory, result)`` each."""
    futures = [(t, workers.submit(t.env.step, t.last_text)) for t in stepping]
    for traj, fut in futures:
        try:
            res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            res = StepResult(observation=f"error: the environment did not answer within "
                                         f"{wait_s:g} s", tool=traj.env_name, error=TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - an environment's own failure ends its episode
            log.warning("environment %s failed on a turn: %s: %s", traj.env_name, type(exc).__name__, exc)
            traj.tool_errors += 1
            res = StepResult(done=True)
        apply(traj, res)


class StepWorkers:
    """A few daemon threads running environment steps (an environment stuck in a step cannot keep
    the process from exiting)."""

    def __init__(self, count: int, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for th in self._threads:
            th.start()

    def submit(self, fn, *args):
        fut = cf.Future()
        self._jobs.put((fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - delivered to the waiting round
                    fut.set_exception(exc)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
