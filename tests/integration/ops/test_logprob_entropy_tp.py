"""Vocab-parallel (TP=2, gloo, torchrun) fused log-prob / entropy equals the single-rank op."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("tp_worker_logprob.py")


def test_tp2_vocab_parallel_equals_tp1():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "OK 5 vocab-parallel cases + processed" in proc.stdout
