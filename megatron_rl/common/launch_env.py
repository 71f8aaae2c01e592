"""The torch.distributed launch contract, checked whole before the world starts.

A launcher (torchrun, Slurm's srun through ``slurm/node_launch.sh``, or a person by hand) gives each
trainer process its place through environment variables: ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. torch reads them inside
``init_process_group`` and answers a missing, mistyped or inconsistent one with a ``ValueError`` or
``RuntimeError`` traceback, or by waiting for peers that never come. :func:`read_launch_env` checks
every one of them first and answers a mistake with a :class:`LaunchEnvError` naming the variable
(an :class:`~megatron_rl.common.errors.InputError`: one line, exit 2). :func:`meeting_failed` turns
torch's own rendezvous failures (a port already taken, no rank 0 at the address, ranks that never
joined) into the same kind of line.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Mapping

from megatron_rl.common.errors import InputError

TORCHRUN_HINT = "launch with torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
# How long a MASTER_ADDR lookup may take before it is left to torch (a slow DNS is not a mistake).
RESOLVE_WAIT_S = 5.0
_HOST = re.compile(r"[A-Za-z0-9_.:%\[\]-]+")


class LaunchEnvError(InputError):
    """A torch.distributed variable that cannot work; the message names it."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the world, as its launcher gave it (checked)."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None

    @property
    def rendezvous(self) -> bool:
        """Whether the processes meet at MASTER_ADDR:MASTER_PORT (else a one-process world on a file)."""
        return self.master_addr is not None and self.master_port is not None


def _whole(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or not text.isascii() or int(text) < minimum:
        raise LaunchEnvError(f"{name} must be a whole number >= {minimum}, got {raw!r}")
    return int(text)


def rank_hint(env: Mapping[str, str] | None = None) -> int:
    """``RANK`` when it is a whole number, else 0: for what runs before the check (the console's
    level, the prefix of the error line itself)."""
    raw = (os.environ if env is None else env).get("RANK", "0").strip()
    return int(raw) if raw.isdigit() and raw.isascii() else 0


def read_launch_env(env: Mapping[str, str] | None = None, *, resolve: bool = True) -> LaunchEnv:
    """Every torch.distributed variable, checked: types, ranges, the ranks against the world, the
    rendezvous address of a world of several processes (``resolve``: MASTER_ADDR must resolve)."""
    env = os.environ if env is None else env
    world = _whole(env, "WORLD_SIZE", 1)
    rank = _whole(env, "RANK", 0)
    local_rank = _whole(env, "LOCAL_RANK", 0)
    local_world = _whole(env, "LOCAL_WORLD_SIZE", 1)
    if world is None:
        if rank not in (None, 0):
            raise LaunchEnvError(f"RANK={rank} but WORLD_SIZE is not set (a one-process world has rank 0 "
                                 f"only): {TORCHRUN_HINT}")
        world = 1
    if world > 1 and rank is None:
        raise LaunchEnvError(f"WORLD_SIZE={world} but RANK is not set: {TORCHRUN_HINT}")
    rank = rank or 0
    if rank >= world:
        raise LaunchEnvError(f"RANK={rank} must be < WORLD_SIZE={world} (ranks count from 0)")
    if local_world is not None and local_world > world:
        raise LaunchEnvError(f"LOCAL_WORLD_SIZE={local_world} must be <= WORLD_SIZE={world}")
    local_rank = local_rank or 0
    if local_rank >= (local_world or world):
        what = f"LOCAL_WORLD_SIZE={local_world}" if local_world is not None else f"WORLD_SIZE={world}"
        raise LaunchEnvError(f"LOCAL_RANK={local_rank} must be < {what} (local ranks count from 0 on each node)")
    addr, port = _rendezvous(env, world, resolve)
    return LaunchEnv(world, rank, local_rank, local_world, addr, port)


def _rendezvous(env: Mapping[str, str], world: int, resolve: bool) -> tuple[str | None, int | None]:
    addr, raw_port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world > 1:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", raw_port)) if v is None]
        if missing:
            raise LaunchEnvError(f"WORLD_SIZE={world} but {' and '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not set (where rank 0 waits for the "
                                 f"others): {TORCHRUN_HINT}")
    port = None
    if raw_port is not None:
        text = raw_port.strip()
        if not (text.isdigit() and text.isascii() and 1 <= int(text) <= 65535):
            raise LaunchEnvError(f"MASTER_PORT must be a port number from 1 to 65535, got {raw_port!r}")
        port = int(text)
    if addr is not None:
        if not _HOST.fullmatch(addr.strip()):
            raise LaunchEnvError(f"MASTER_ADDR must be rank 0's host name or address, got {addr!r}")
        addr = addr.strip()
        if resolve and world > 1:
            _check_resolves(addr)
    return addr, port


def _check_resolves(addr: str) -> None:
    """MASTER_ADDR must name a host; a lookup that takes longer than ``RESOLVE_WAIT_S`` is left to torch."""
    answer: dict = {}

    def look_up():
        try:
            socket.getaddrinfo(addr.strip("[]"), None)
            answer["ok"] = True
        except (OSError, UnicodeError) as exc:
            answer["error"] = exc

    t = threading.Thread(target=look_up, daemon=True)
    t.start()
    t.join(RESOLVE_WAIT_S)
    if "error" in answer:
        raise LaunchEnvError(f"MASTER_ADDR={addr!r} does not resolve to an address "
                             f"({getattr(answer['error'], 'strerror', None) or answer['error']}): "
                             f"it must be rank 0's host name or address")


def check_device(local_rank: int, devices: int) -> None:
    """On GPUs each process of a node takes the device of its LOCAL_RANK."""
    if local_rank >= devices:
        raise LaunchEnvError(f"LOCAL_RANK={local_rank} but this node has {devices} GPU(s): run at most "
                             f"{devices} trainer process(es) per node (torchrun --nproc-per-node)")


def meeting_failed(env: LaunchEnv, exc: BaseException, timeout_s: float) -> LaunchEnvError:
    """torch's rendezvous failure (port taken, no rank 0 at the address, ranks missing) as one line."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return LaunchEnvError(f"the {env.world_size} trainer process(es) could not meet at MASTER_ADDR={env.master_addr} "
                          f"MASTER_PORT={env.master_port} (this is RANK={env.rank}; waited up to {timeout_s:g} s, "
                          f"policy.parallel.timeout_s): {first}. Are all WORLD_SIZE={env.world_size} processes "
                          f"started, with the same MASTER_ADDR and MASTER_PORT, and the port free?")
