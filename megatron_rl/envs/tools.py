"""Running an environment's tools within their limits.

:meth:`ToolRunner.call` runs an in-process tool (a bounded function: the calculator) on a thread of
its own and waits at most ``envs.tool_timeout_s``: a tool that does not answer in time is a timeout
(its thread is left behind, a daemon). :meth:`ToolRunner.run_python` runs a program in the code
sandbox (``rewards/sandbox.py``, with ``reward.code.sandbox``'s limits and a wall clock of
``envs.tool_timeout_s``) inside a spawned worker of a hard-timeout process pool (``rewards/pool.py``:
a worker stuck past the limit is killed and replaced), never in the trainer's own process; the calls
of concurrent episodes are run together, ``envs.num_workers`` at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from megatron_rl.rewards.config import SandboxConfig

# ToolOutput.error values.
ERROR, TIMEOUT = "error", "timeout"
# What the pool adds to a program's own wall clock before it kills the worker (bwrap's start-up).
_POOL_GRACE_S = 10.0


@dataclass
class ToolOutput:
    """A tool's answer: the text the model gets, and how the call failed ("" if it did not)."""

    text: str
    error: str = ""


def run_sandboxed(code: str, stdin: str, sandbox: dict, timeout_s: float) -> tuple:
    """The pool task: ``code`` as a Python program in the sandbox (in a pool worker). Returns
    ``(returncode, stdout, stderr, timed_out)``."""
    from megatron_rl.rewards.sandbox import Sandbox

    res = Sandbox(SandboxConfig.from_dict(sandbox)).run_python(code, stdin=stdin, timeout_s=timeout_s)
    return res.returncode, res.stdout, res.stderr, res.timed_out


def program_output(rc: int | None, stdout: str, stderr: str, timed_out: bool, timeout_s: float) -> ToolOutput:
    """What a program's run tells the model: its stdout; on failure its stderr too, flagged."""
    if timed_out:
        return ToolOutput(f"{stdout}error: the program did not finish within {timeout_s:g} s (killed)", TIMEOUT)
    if rc != 0:
        why = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}"
        return ToolOutput(f"{stdout}{stderr}error: the program failed ({why})", ERROR)
    return ToolOutput(stdout + stderr)


class ToolRunner:
    """The tools of every episode of a run (thread-safe)."""

    def __init__(self, timeout_s: float, num_workers: int, sandbox: SandboxConfig | None = None,
                 wait_s: float = 600.0):
        """``wait_s``: how long a sandboxed call may wait for a free worker and run (a bound on every
        wait; the program itself is stopped after ``timeout_s``)."""
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.sandbox = sandbox or SandboxConfig()
        self.wait_s = wait_s
        self._pool = None
        self._calls: queue.Queue = queue.Queue()
        self._dispatcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- in-process tools -----------------------------------------------------------------------
    def call(self, fn: Callable[..., str], *args) -> ToolOutput:
        """``fn(*args)`` (returns the tool's text; raises ValueError for a bad input) within the time
        limit, on a thread of its own."""
        fut: cf.Future = cf.Future()

        def run() -> None:
            try:
                fut.set_result(ToolOutput(str(fn(*args))))
            except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's error message
                fut.set_result(ToolOutput(f"error: {exc}" if isinstance(exc, ValueError) else
                                          f"error: {type(exc).__name__}: {exc}", ERROR))

        threading.Thread(target=run, name="tool-call", daemon=True).start()
        try:
            return fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            return ToolOutput(f"error: the tool did not answer within {self.timeout_s:g} s", TIMEOUT)

    # -- sandboxed programs ---------------------------------------------------------------------
    def run_python(self, code: str, stdin: str = "") -> ToolOutput:
        """``code`` as a program in the code sandbox, in a worker process."""
        fut: cf.Future = cf.Future()
        self._start()
        self._calls.put(((code, stdin), fut))
        try:
            rc, out, err, timed_out = fut.result(timeout=self.wait_s)
        except cf.TimeoutError:
            return ToolOutput(f"error: no tool worker answered within {self.wait_s:g} s", TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the worker died, or the pool could not start
            return ToolOutput(f"error: the tool failed: {exc}", ERROR)
        return program_output(rc, out, err, timed_out, self.timeout_s)

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, name="tool-pool", daemon=True)
                self._dispatcher.start()

    def _dispatch(self) -> None:
        """Run queued programs in batches through the pool (it takes one caller at a time)."""
        from megatron_rl.rewards.pool import HardTimeoutPool

        sandbox = dataclasses.asdict(self.sandbox)
        while True:
            first = self._calls.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._calls.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                if self._pool is None:
                    self._pool = HardTimeoutPool(self.num_workers, preload=(__name__,))
                tasks = [(run_sandboxed, (code, stdin, sandbox, self.timeout_s), self.timeout_s + _POOL_GRACE_S)
                         for (code, stdin), _ in batch]
                results = self._pool.run(tasks)
            except Exception as exc:  # noqa: BLE001 - every waiting call gets the failure
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            for (_, fut), res in zip(batch, results):
                if res.status == "ok":
                    fut.set_result(res.value)
                elif res.status == "timeout":  # the pool killed the worker: the program ran too long
                    fut.set_result((None, "", "", True))
                else:
                    fut.set_exception(RuntimeError(res.error))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            started = self._dispatcher is not None
        if started:
            self._calls.put(None)
            self._dispatcher.join(timeout=self.timeout_s + _POOL_GRACE_S + 5)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
