"""CPU placement (``trainer.cpu_cores``): the trainer computes on its own cores; the engines of the
vLLM servers it starts and its reward workers compute on the others; the servers' front ends and the
fleet client's thread run on any of them.

On a small CPU machine (the 2-core demo) one-step-off GRPO overlaps generation with training only if
the two do not share a core: the trainer's process is pinned to ``trainer.cpu_cores``
(:func:`place_trainer`, every thread it has and every one it starts), and the rest of the CPUs it
was given become the helpers' (recorded in the environment, ``MRL_HELPER_CPUS``, so that processes
started later see them too; every CPU it was given in ``MRL_ALL_CPUS``). Who reads them:

- the servers the trainer launches (``rollout/launcher.py``): vLLM's OpenMP binding
  (``VLLM_CPU_OMP_THREADS_BIND``) puts the engine's computing thread (the worker, in the engine
  core's process) on the helpers' CPUs; the rest of the server (the API server's process: HTTP,
  and every step's output processing) may run on any CPU the trainer was given
  (:func:`server_environment`), so it takes the time the trainer leaves, not the engine's core;
- the vLLM fleet client's event-loop thread (``rollout/fleet.py``), the same way
  (:func:`float_over_all`): it sends and receives the wave in flight wherever a core is free;
- the reward workers (``rewards/pool.py``): :func:`pin_to_helpers`, so scoring never takes the
  trainer's core.

Measured on the 2-core demo (one-step-off, generation-bound: the engine's wave takes longer than
the trainer's update): a server pinned whole to the engine's core generated a wave in 1.9 s where
the in-process engine takes 1.4 s, and one-step-off was no faster than the in-process loop (1.02x);
with the front end free to use the trainer's idle core (and no detokenization on the server,
``rollout/server.py``) the trainer's wait for the wave halved and one-step-off took 0.78x the
in-process loop's step (benchmarks/RESULTS.md, issue 28).

An in-process engine (``rollout.engine=vllm``) lives in the trainer's process and computes on its
cores (its OpenMP binding follows them). Without ``trainer.cpu_cores`` nothing is pinned.
"""

from __future__ import annotations

import os
from pathlib import Path

HELPER_ENV = "MRL_HELPER_CPUS"
ALL_ENV = "MRL_ALL_CPUS"
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# A launched server's own CPUs, applied by its first code (the lifeline) before vLLM starts.
PIN_ENV = "MRL_PIN_CPUS"


def _set_all_threads(cores: set[int]) -> None:
    """Pin every thread of this process (``sched_setaffinity`` acts on one thread at a time)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass


def place_trainer(cores: list[int]) -> list[int]:
    """Pin this process to ``cores`` and make the other CPUs it may use the helpers' (returned;
    empty when ``cores`` takes them all). A core this process may not use is a ``ValueError``."""
    available = sorted(os.sched_getaffinity(0))
    bad = sorted(set(cores) - set(available))
    if bad:
        raise ValueError(f"core(s) {bad} are not among the CPUs this process may use {available}")
    helpers = [c for c in available if c not in cores]
    _set_all_threads(set(cores))
    os.environ[OMP_BIND_ENV] = ",".join(map(str, sorted(cores)))  # an engine in this process
    os.environ[ALL_ENV] = ",".join(map(str, available))
    if helpers:
        os.environ[HELPER_ENV] = ",".join(map(str, helpers))
    else:
        os.environ.pop(HELPER_ENV, None)
    return helpers


def helper_cpus() -> list[int]:
    """The helpers' CPUs :func:`place_trainer` set aside (empty: no placement)."""
    return _cpus(HELPER_ENV)


def _cpus(name: str) -> list[int]:
    return [int(c) for c in os.environ.get(name, "").split(",") if c.strip()]


def all_cpus() -> list[int]:
    """Every CPU the trainer was given (empty: no placement)."""
    return _cpus(ALL_ENV) if helper_cpus() else []


def pin_to_helpers() -> None:
    """Pin the calling thread (and what it starts later) to the helpers' CPUs, if there are any."""
    cpus = helper_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)


def float_over_all() -> None:
    """Let the calling thread (and what it starts later) run on every CPU the trainer was given
    (a thread of the trainer's process is on its cores otherwise), when there are helpers."""
    cpus = all_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)


def server_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a copy of this process's) for a server it launches, when there are helpers: vLLM's
    OpenMP binding (its computing thread) on the helpers' CPUs, never the trainer's own cores; the
    server's other threads and processes (:data:`PIN_ENV`, applied by :func:`pin_from_environment`)
    on every CPU the trainer was given."""
    cpus = helper_cpus()
    if cpus:
        env[OMP_BIND_ENV] = ",".join(map(str, cpus))
        env[PIN_ENV] = ",".join(map(str, all_cpus() or cpus))
    else:
        env.pop(PIN_ENV, None)
    return env


def pin_from_environment() -> None:
    """In a launched server's process, first thing: pin it to :data:`PIN_ENV`'s CPUs when set."""
    cpus = _cpus(PIN_ENV)
    if cpus:
        _set_all_threads(set(cpus))
