"""A process pool with a hard per-task timeout: a stuck worker is killed and replaced.

``concurrent.futures`` cannot cancel a running task, and math-verify's SIGALRM cannot interrupt C
code (``9^{9^{9}}`` spends minutes inside one big-int power holding the GIL). Here every task has a
deadline; past it the worker gets SIGKILL, a fresh one is spawned, and the task reports ``timeout``.
A worker that dies (segfault, OOM kill) reports ``error`` for its task and is replaced too.

Workers are spawned (never forked from a trainer holding threads and CUDA state); each imports the
modules that define the task functions once, calls their ``warmup()`` if they have one, then
reports ready; task deadlines start only when a ready worker receives the task.

Each worker's stderr goes to its own log file, so a worker that dies says why: a start failure
raises with the end of that log (a spawned worker first re-imports the launcher's ``__main__``
module, so a launcher without an ``if __name__ == "__main__":`` guard fails there, before any of
our code runs, and only its stderr tells), and a death during a task logs it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

from megatron_rl.common.cpus import pin_to_helpers

log = logging.getLogger(__name__)

# Consecutive worker deaths before "ready" after which the pool gives up (a broken environment).
_MAX_START_FAILURES = 3
# How much of a dead worker's stderr log an error message quotes (its end).
_LOG_TAIL_CHARS = 4000
# Serialises the moment fd 2 points at a worker's log (see _start_with_stderr).
_SPAWN_LOCK = threading.Lock()


@dataclass
class TaskResult:
    status: str  # "ok" | "timeout" | "error"
    value: Any = None
    error: str = ""


def _resolve(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(module), name)


def _address_space_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker_main(conn, preload: tuple[str, ...], memory_mb: int, setup: tuple = ()) -> None:
    pin_to_helpers()  # trainer.cpu_cores: scoring never takes the trainer's core
    if memory_mb > 0:  # on top of what the interpreter already maps (spawn may import __main__)
        limit = _address_space_bytes() + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for module in preload:
        warmup = getattr(importlib.import_module(module), "warmup", None)
        if callable(warmup):  # pay first-call costs (grammar loading, imports) before any deadline
            warmup()
    for module, name, args in setup:  # e.g. loading the user's reward functions
        _resolve(module, name)(*args)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, module, name, args = msg
        try:
            value = _resolve(module, name)(*args)
            conn.send((task_id, "ok", value))
        except BaseException as exc:  # a task's failure is a result, never the worker's death
            conn.send((task_id, "error", f"{type(exc).__name__}: {exc}"[:2000]))


def _start_with_stderr(proc, log_path: str) -> None:
    """``proc.start()`` with the child's stderr (fd 2) writing to ``log_path``.

    A spawned child inherits fd 2 and prints there whatever kills it before our code runs
    (re-importing ``__main__``, unpickling its target); multiprocessing has no option for the
    child's stdio, so fd 2 points at the log for the instant of the spawn and is then restored.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started inside the window, it would keep the log as stderr
    with _SPAWN_LOCK, open(log_path, "ab", buffering=0) as log_file:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(log_file.fileno(), 2)
            proc.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _Worker:
    def __init__(self, ctx, preload, memory_mb, log_dir: str, setup: tuple = ()):
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=_worker_main, args=(child, preload, memory_mb, setup), daemon=True)
        fd, self.log_path = tempfile.mkstemp(prefix="worker-", suffix=".stderr", dir=log_dir)
        os.close(fd)
        _start_with_stderr(self.proc, self.log_path)
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def stderr_tail(self) -> str:
        """The end of what this worker wrote to stderr ("" if nothing)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - _LOG_TAIL_CHARS))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""


class HardTimeoutPool:
    """``run(tasks)`` executes ``fn(*args)`` for each ``(fn, args, timeout_s)`` and never hangs.

    ``fn`` must be a module-level function. Results come back in task order.
    """

    def __init__(self, num_workers: int, preload: tuple[str, ...] = (), memory_mb: int = 0,
                 start_timeout_s: float = 120.0, setup: tuple = ()):
        """``preload``: modules each worker imports (and whose ``warmup()`` it calls) before it reports
        ready; ``setup``: then these calls, ``(module, function name, args)``."""
        self._ctx = mp.get_context("spawn")
        self._preload = tuple(preload)
        self._setup = tuple(setup)
        self._memory_mb = memory_mb
        self._start_timeout_s = start_timeout_s
        self._log_dir = tempfile.TemporaryDirectory(prefix="mrl-reward-workers-")
        self._workers = [self._spawn() for _ in range(num_workers)]
        self.restarts = 0
        self._next_id = 0
        self._start_failures = 0
        self._closed = False

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._preload, self._memory_mb, self._log_dir.name, self._setup)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._spawn()
        self.restarts += 1

    def run(self, tasks: list[tuple[Callable, tuple, float]]) -> list[TaskResult]:
        if self._closed:
            raise RuntimeError("pool is closed")
        for i, w in enumerate(self._workers):
            if w.task is not None:  # left busy by an interrupted run: its answer would be stale
                self._replace(i)
        results: list[TaskResult | None] = [None] * len(tasks)
        pending = list(range(len(tasks)))[::-1]  # pop() takes the next in order
        base = self._next_id  # ids are unique across runs; a late answer from before is ignored
        self._next_id += len(tasks)
        done = 0
        while done < len(tasks):
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    t = pending.pop()
                    fn, args, timeout_s = tasks[t]
                    try:
                        w.conn.send((base + t, fn.__module__, fn.__qualname__, args))
                    except (BrokenPipeError, OSError):
                        pending.append(t)
                        self._replace(i)
                        continue
                    w.task, w.deadline = t, now + timeout_s
            busy = [w for w in self._workers if w.task is not None or not w.ready]
            deadlines = [w.deadline for w in busy if w.task is not None]
            deadlines += [w.started + self._start_timeout_s for w in busy if not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.1
            ready_conns = wait_any([w.conn for w in busy], timeout=wait_s)
            for i, w in enumerate(self._workers):
                if w.conn in ready_conns:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is None:  # the worker died
                        if not w.ready:
                            # killed while starting (OOM killer, a user) or broken imports: retry a
                            # few times, then give up loudly (a broken environment, not a sample)
                            self._start_failures += 1
                            if self._start_failures > _MAX_START_FAILURES:
                                w.proc.join(timeout=5)
                                code, tail = w.proc.exitcode, w.stderr_tail()
                                w.kill()
                                raise RuntimeError(
                                    f"reward worker failed to start {self._start_failures} times in a "
                                    f"row (last exit code {code}); preloaded: {self._preload}; the "
                                    f"worker's stderr ended with:\n{tail or '(nothing)'}")
                            self._replace(i)
                            continue
                        t = w.task
                        w.proc.join(timeout=5)
                        results[t] = TaskResult("error", error=f"worker died (exit {w.proc.exitcode})")
                        done += 1
                        log.warning("reward worker died on task %d (exit %s); respawning. Its stderr "
                                    "ended with:\n%s", t, w.proc.exitcode,
                                    w.stderr_tail() or "(nothing)")
                        self._replace(i)
                    elif msg[0] == "ready":
                        w.ready = True
                        self._start_failures = 0
                    else:
                        tid, status, value = msg
                        if tid - base != w.task:
                            continue  # stale
                        results[w.task] = TaskResult(status, value if status == "ok" else None,
                                                     "" if status == "ok" else value)
                        w.task = None
                        done += 1
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.task is not None and now > w.deadline:
                    results[w.task] = TaskResult("timeout", error="hard timeout: worker killed")
                    done += 1
                    log.warning("reward task %d passed its hard timeout; killing worker %d",
                                w.task, w.proc.pid)
                    self._replace(i)
                elif not w.ready and now > w.started + self._start_timeout_s:
                    tail = w.stderr_tail()
                    w.kill()
                    raise RuntimeError(f"reward worker did not start within "
                                       f"{self._start_timeout_s}s; its stderr ended with:\n"
                                       f"{tail or '(nothing)'}")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._log_dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
