"""A trainer does not join a W&B service it inherits from the process that started it.

The parent here opens a W&B run and keeps it open, as a trainer killed with -9 leaves its stream
open in the service it used; the child, started with the parent's environment (WANDB_SERVICE
included), resumes the same run id, as a requeued trainer does. Through the inherited service
wandb refuses it ("run ID ... is in use")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PARENT = textwrap.dedent("""
    import json, os, subprocess, sys
    import wandb
    run_dir, run_id = sys.argv[1], sys.argv[2]
    run = wandb.init(project="p", id=run_id, resume="allow", mode="offline", dir=run_dir,
                     settings=wandb.Settings(console="off", x_disable_stats=True))
    run.log({"x": 1.0}, step=1)
    assert os.environ.get("WANDB_SERVICE"), "wandb no longer exports its service: revisit the tracker"
    child = subprocess.run([sys.executable, "-c", sys.argv[3], run_dir, run_id],
                           capture_output=True, text=True, timeout=120)
    print(json.dumps({"rc": child.returncode, "out": child.stdout[-2000:], "err": child.stderr[-3000:]}))
    os._exit(0)  # leave the parent's stream open, as a killed trainer does
""")

CHILD = textwrap.dedent("""
    import sys
    from megatron_rl.tracking.config import TrackingConfig
    from megatron_rl.tracking.tracker import Tracker
    run_dir, run_id = sys.argv[1], sys.argv[2]
    t = Tracker(TrackingConfig(wandb_mode="offline", wandb_project="p"), run_dir, {"a": 1}, wandb_run_id=run_id)
    t.log({"loss": 0.5}, step=2, stage="s")
    t.close()
    print("resumed", t.wandb_run_id)
""")


def test_resumed_tracker_does_not_join_the_parents_wandb_service(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_SILENT="true", WANDB_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path / "run"), "abc123def456", CHILD],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["rc"] == 0, child["err"]
    assert "resumed abc123def456" in child["out"]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
