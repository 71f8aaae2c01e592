"""A launched server dies with the process that owns it, however that process died.

Every server :class:`~megatron_rl.rollout.launcher.ServerProcess` starts runs as
``python -m megatron_rl.rollout.lifeline OWNER_PID MODULE ARGS...``: a watchdog thread, then
``MODULE`` (vLLM's API server) run as ``__main__`` in this same process, so the server's pid, its
command line and its process group are what they would be without the wrapper. It first pins the
process to the CPUs the trainer left it, if any (``trainer.cpu_cores``, ``common/cpus.py``). The server runs in
its own session; the watchdog checks every :data:`POLL_S` that the process's parent is still
``OWNER_PID``, and once it is not (the owner exited or was killed, SIGKILL included, and the server
was re-parented to init or a subreaper) it kills the server's whole process group: the API server,
its EngineCore and workers. A trainer, test or benchmark killed with ``kill -9`` then leaves no
server holding its memory.

Why the parent's pid: ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned the child exits,
and the launcher's supervisor restarts servers from its own thread; a lifetime pipe's write end is
inherited by every process the owner forks (reward pools, data workers), and one of them that
outlived the owner would keep the server alive. The parent of a process is its creator's process,
not its thread, and it changes exactly when that process is gone.

Servers nobody here started (``rollout.placement=external``) are not touched; servers a node
launcher started (``megatron-rl engines``, the sbatch scripts' engine step) die with that launcher,
not with the trainer.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

from megatron_rl.common.cpus import pin_from_environment

# How often the watchdog looks at the server's parent (the server outlives its owner by at most this).
POLL_S = 0.5


def owned(command: list[str], owner_pid: int) -> list[str]:
    """``command`` (``python -m MODULE ARGS...``) run under the lifeline of ``owner_pid``."""
    if len(command) < 3 or command[1] != "-m":
        raise ValueError(f"the lifeline runs `python -m MODULE ...` commands, not {command[:3]}")
    return [command[0], "-m", __name__, str(owner_pid), *command[2:]]


def watch(owner_pid: int, poll_s: float = POLL_S) -> threading.Thread:
    """Start the thread that kills this process group once ``owner_pid`` is no longer the parent."""

    def run() -> None:
        while os.getppid() == owner_pid:
            time.sleep(poll_s)
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole server: API server, EngineCore, workers
        finally:
            os._exit(1)  # not reached when the group is this process's

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m megatron_rl.rollout.lifeline OWNER_PID MODULE [ARGS...]")
    owner_pid, module, args = int(argv[0]), argv[1], argv[2:]
    pin_from_environment()  # trainer.cpu_cores: the server on the CPUs the trainer left it
    watch(owner_pid)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
