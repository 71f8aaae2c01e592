"""CPU placement (``trainer.cpu_cores``): the trainer computes on its own cores; the vLLM servers it
starts and its helpers run on the others.

On a small CPU machine (the 2-core demo) one-step-off GRPO overlaps generation with training only if
the two do not share a core: the trainer's process is pinned to ``trainer.cpu_cores``
(:func:`place_trainer`, every thread it has and every one it starts), and the rest of the CPUs it
was given become the helpers' (recorded in the environment, ``MRL_HELPER_CPUS``, so that processes
started later see them too). Who reads them:

- the servers the trainer launches (``rollout/launcher.py``): their process affinity and vLLM's
  OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``);
- the reward workers (``rewards/pool.py``) and the vLLM fleet client's event-loop thread
  (``rollout/fleet.py``): :func:`pin_to_helpers`, so scoring and the HTTP traffic of the wave in
  flight never take the trainer's core.

An in-process engine (``rollout.engine=vllm``) lives in the trainer's process and computes on its
cores (its OpenMP binding follows them). Without ``trainer.cpu_cores`` nothing is pinned.
"""

from __future__ import annotations

import os
from pathlib import Path

HELPER_ENV = "MRL_HELPER_CPUS"
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
    if helpers:
        os.environ[HELPER_ENV] = ",".join(map(str, helpers))
    else:
        os.environ.pop(HELPER_ENV, None)
    return helpers


def helper_cpus() -> list[int]:
    """The helpers' CPUs :func:`place_trainer` set aside (empty: no placement)."""
    value = os.environ.get(HELPER_ENV, "")
    return [int(c) for c in value.split(",") if c.strip()]


def pin_to_helpers() -> None:
    """Pin the calling thread (and what it starts later) to the helpers' CPUs, if there are any."""
    cpus = helper_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)


def server_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a copy of this process's) for a server it launches: on the helpers' CPUs, when there
    are, its process (:data:`PIN_ENV`, applied by :func:`pin_from_environment`) and vLLM's OpenMP
    binding; never the trainer's own cores."""
    cpus = helper_cpus()
    if cpus:
        env[PIN_ENV] = env[OMP_BIND_ENV] = ",".join(map(str, cpus))
    else:
        env.pop(PIN_ENV, None)
    return env


def pin_from_environment() -> None:
    """In a launched server's process, first thing: pin it to :data:`PIN_ENV`'s CPUs when set."""
    cpus = [int(c) for c in os.environ.get(PIN_ENV, "").split(",") if c.strip()]
    if cpus:
        _set_all_threads(set(cpus))
