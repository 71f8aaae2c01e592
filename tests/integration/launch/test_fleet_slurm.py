"""Rollout engines launched by the Slurm scripts, with the CPU miniature (vLLM servers, gloo sync).

- dedicated: ``sbatch slurm/stage1_8k.sh`` with ``ROLLOUT_PLACEMENT=dedicated`` runs the engines as
  their own srun step and the trainer uses them. The local cluster has one node, so the engine host
  (``ROLLOUT_HOSTS``) is that node, shared with the trainer step (the engine step runs with
  ``--overlap``): the emulation of a dedicated engine node.
- colocated: every trainer node's launcher (slurm/node_launch.sh) starts its node's engines before
  the trainer. Two nodes are emulated inside one Slurm job on the one-node cluster by running the
  node launcher twice (two srun tasks) with two node ranks: node names n0 / n1, servers bound to
  127.0.0.2 / 127.0.0.3, one torchrun per "node" joined by a c10d rendezvous (a 2-rank trainer).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.launch.conftest import MINI_RECIPE, REPO, read_metrics, run_state, trainer_env

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 600
ENGINE_OVERRIDES = ("sync.transport=gloo sync.bucket_bytes=1048576 rollout.max_num_seqs=32 "
                    "rollout.start_timeout_s=400 stages.0.max_steps=2")


def _server_processes(model_dir: Path) -> list[str]:
    """vLLM server processes still serving ``model_dir`` (none must outlive the job)."""
    out = subprocess.run(["pgrep", "-af", "vllm.entrypoints.launchers.api_server"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if str(model_dir) in line]


def _engine_rows(run_dir: Path, stage: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["stage"] == stage]


def _node() -> str:
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slurm
def test_fleet_sbatch_dedicated_runs_the_engines_as_their_own_step(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    node = _node()
    env = trainer_env(CONFIG=str(MINI_RECIPE), RUN_DIR=str(run_dir), LAUNCHER="direct", NPROC_PER_NODE="1",
                      ROLLOUT_PLACEMENT="dedicated", ROLLOUT_HOSTS=node, OVERRIDES=ENGINE_OVERRIDES)
    proc = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--gpus-per-node=1", "--cpus-per-task=2",
                           "--time=00:15:00", f"--output={tmp_path}/slurm-%j.out", str(REPO / "slurm" / "stage1_8k.sh")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    job = proc.stdout.split()[0] if proc.stdout.split() else "?"
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace") if (tmp_path / f"slurm-{job}.out").exists() else ""
    assert proc.returncode == 0, log[-5000:] + proc.stderr[-2000:]
    assert run_state(run_dir)["finished_stages"] == ["stage1_12"]
    # the engines ran as their own srun step on the engine host, and stopped after the trainer
    assert f"engine step on {node}" in log and "engine step stopped" in log
    assert f"engine {node}-0 at http://" in log  # printed by `megatron-rl engines` in that step
    assert (run_dir / "engines" / "logs" / f"{node}-0.log").exists()
    rows = _engine_rows(run_dir, "stage1_12")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/engines_up"] == 1 and r["rollout/requeued_requests"] == 0 for r in rows)
    assert all(r["sync/engines"] == 1 and r["sync/failed_engines"] == 0 for r in rows if "sync/engines" in r)
    assert not _server_processes(run_dir / "base_model")
    assert not list((run_dir / "engines").glob("*.json"))  # unregistered when stopped


@pytest.mark.slurm
def test_fleet_colocated_node_launchers_start_their_nodes_engines(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # What slurm/common.sh exports for a colocated run of a config with vLLM servers.
    overrides = f"rollout.engine=vllm_server rollout.placement=colocated rollout.num_engines=0 {ENGINE_OVERRIDES}"
    engine_args = f"engines --config {MINI_RECIPE} --run-dir {run_dir} {overrides}"
    train = (f"-m megatron_rl.cli train --config {MINI_RECIPE} --run-dir {run_dir} --stage stage1_12 {overrides}")
    script = tmp_path / "two_nodes.sh"
    script.write_text(f"""#!/usr/bin/env bash
# one "node" per srun task: its name, its address, its node rank
export MRL_NODE_NAME=n$SLURM_PROCID MRL_NODE_HOST=127.0.0.$((SLURM_PROCID + 2))
exec bash {REPO}/slurm/node_launch.sh {sys.executable} -m torch.distributed.run --nnodes=2 \\
  --node-rank=$SLURM_PROCID --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$MRL_RDZV_PORT \\
  --rdzv-id=mrl-colocated-$SLURM_JOB_ID --max-restarts=0 {train}
""")
    from megatron_rl.rollout.launcher import free_port

    env = trainer_env(LAUNCHER="torchrun", MRL_ENGINE_ARGS=engine_args, MRL_RDZV_PORT=str(free_port("127.0.0.1")))
    wrap = f"srun --ntasks=2 --overlap bash {script}"
    t0 = time.monotonic()
    proc = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks=2", "--cpus-per-task=1",
                           "--time=00:15:00", f"--output={tmp_path}/job.out", "--wrap", wrap],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    log = (tmp_path / "job.out").read_text(errors="replace") if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, log[-6000:] + proc.stderr[-2000:]
    assert run_state(run_dir)["finished_stages"] == ["stage1_12"]
    for node in ("n0", "n1"):  # each node launcher started its own node's engine, before its trainer
        assert f"[node_launch {node} " in log and f"engine {node}-0 at http://127.0.0.{2 + int(node[1])}:" in log
        assert (run_dir / "engines" / "logs" / f"{node}-0.log").exists()
    rows = _engine_rows(run_dir, "stage1_12")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/engines_up"] == 2 for r in rows)
    assert all(r["sync/engines"] == 2 for r in rows if "sync/engines" in r)
    assert not _server_processes(run_dir / "base_model")
    assert time.monotonic() - t0 < JOB_TIMEOUT_S


def test_fleet_nemo_run_dedicated_is_a_heterogeneous_job_with_an_engine_group(nemo_run_env, tmp_path):
    """NeMo-Run dry run (no cluster): group 0 the trainer nodes, group 1 the engine nodes running
    only their vLLM servers; the trainer meets at the first trainer host and names the engine hosts."""
    cmd = [sys.executable, "-m", "launch.run", "--stage", "stage1", "--executor", "slurm", "--dry-run",
           "--nodes", "2", "--gpus-per-node", "8", "--account", "acct", "--rollout-placement", "dedicated",
           "--rollout-nodes", "3", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout[proc.stdout.index("#!/bin/bash"):]
    assert "#SBATCH hetjob" in text
    nodes = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH --nodes=")]
    assert nodes == ["2", "3"]
    sruns = [line for line in text.splitlines() if line.startswith("srun --het-group=")]
    assert len(sruns) == 2
    trainer, engines = sruns
    assert trainer.startswith("srun --het-group=0") and "megatron_rl.cli train" in trainer
    assert "--rdzv-endpoint=$het_group_host_0:" in trainer and '"sync.master_addr=$het_group_host_0"' in trainer
    assert "rollout.placement=dedicated" in trainer and "$SLURM_JOB_NODELIST_HET_GROUP_1" in trainer
    assert engines.startswith("srun --het-group=1")
    assert engines.split()[-4:-2] == [str(REPO / "slurm" / "node_launch.sh"), "--engines"]
    exports = [line for line in text.splitlines() if line.startswith("export MRL_ENGINE_ARGS=")]
    assert len(exports) == 1 and '"engines --config ' in exports[0] and "rollout.placement=dedicated" in exports[0]
