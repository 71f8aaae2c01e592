"""Which processes are alive, for tests that check that nothing outlives its owner."""

from __future__ import annotations

import os
import time


def live_in_group(pgid: int) -> list[int]:
    """Pids of the processes of process group ``pgid`` that are alive (zombies do not count: an
    orphan's zombie waits for init to reap it, its memory is already gone)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            out.append(int(entry))
    return out


def wait_groups_gone(pgids: list[int], timeout_s: float) -> tuple[float, dict[int, list[int]]]:
    """Seconds until no process of ``pgids`` is alive, and what is still alive at ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        alive = {g: live_in_group(g) for g in pgids}
        alive = {g: p for g, p in alive.items() if p}
        if not alive or time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, alive
        time.sleep(0.1)
