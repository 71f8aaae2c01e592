"""Fixtures of the reward tests: bubblewrap installed (the code sandbox), once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# Exit code of scripts/install_bubblewrap.sh when the package cannot be installed here.
CANNOT_INSTALL = 3


@pytest.fixture(scope="session")
def bwrap_sandbox():
    """bubblewrap installed (scripts/install_bubblewrap.sh, idempotent) and working here."""
    from megatron_rl.rewards import sandbox

    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_bubblewrap.sh")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == CANNOT_INSTALL:
        pytest.skip(f"bubblewrap cannot be installed here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, f"scripts/install_bubblewrap.sh failed:\n{proc.stderr}"
    sandbox._isolation.cache_clear()  # probed before the install, maybe
    if sandbox.isolation_mode() != "bwrap":
        pytest.skip(f"bubblewrap cannot isolate programs here: {sandbox.isolation_problem()}")
    return sandbox.isolation_mode()
