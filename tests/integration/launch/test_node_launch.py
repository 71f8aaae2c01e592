"""slurm/node_launch.sh: how a stop request reaches the trainer processes, and only them.

A stand-in trainer (stop_worker.py) starts a spawned helper like Megatron's checkpoint writer and
vLLM do; the helper dies on any USR1, so "helper alive" at the stop proves the signal went to the
trainer processes alone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.launch.conftest import REPO, trainer_env

pytestmark = pytest.mark.slow

NODE_LAUNCH = REPO / "slurm" / "node_launch.sh"
STOP_WORKER = Path(__file__).resolve().parent / "stop_worker.py"


def _wait_files(paths: list[Path], proc: subprocess.Popen | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc is None or proc.poll() is None, f"ended with {proc.returncode} before {paths} existed"
        assert time.monotonic() < deadline, f"{paths} did not all appear in {timeout} s"
        time.sleep(0.1)


def test_stop_file_reaches_each_torchrun_worker_and_exit_is_99(tmp_path):
    stop = tmp_path / "stop"
    env = trainer_env(LAUNCHER="torchrun", MRL_STOP_FILE=str(stop), VENV="")
    proc = subprocess.Popen(
        ["bash", str(NODE_LAUNCH), "torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(STOP_WORKER), str(tmp_path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_files([tmp_path / "ready-0", tmp_path / "ready-1"], proc)
        stop.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # torchrun reports the workers' 99 as 1; node_launch.sh restores "checkpointed, requeue me".
    assert proc.returncode == 99, err[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"stopped-{rank}").read_text() == "helper alive"


@pytest.mark.slurm
def test_time_limit_watch_stops_a_slurm_step_without_signalling_helpers(slurm_cluster, tmp_path):
    # A 1-minute job asked to stop 70 s before its limit: the first check (at start) requests it.
    env = trainer_env(LAUNCHER="direct", MRL_STOP_BEFORE_END_S="70", VENV="")
    wrap = f"srun bash {NODE_LAUNCH} {sys.executable} {STOP_WORKER} {tmp_path} 50"
    proc = subprocess.run(["sbatch", "--wait", "--time=1", f"--output={tmp_path}/job.out", "--wrap", wrap],
                          env=env, capture_output=True, text=True, timeout=180)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 99, f"{proc.stderr}\n{log[-3000:]}"  # sbatch --wait: the job's exit code
    assert (tmp_path / "stopped-0").read_text() == "helper alive"
    assert "asking the trainer processes to checkpoint" in log
