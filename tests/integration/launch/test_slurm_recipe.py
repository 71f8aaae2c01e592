"""The recipe's stage scripts on a real one-node Slurm cluster, with the CPU miniature.

- ``sbatch --wait ... slurm/stage1_8k.sh`` then ``... slurm/stage2_16k.sh``: the command lines of
  docs/recipe.md's local-cluster block, run as written (only the config is the miniature's and the
  run dir the test's; the log path and a time limit come from SBATCH_OUTPUT / SBATCH_TIMELIMIT in
  the environment, which the commands leave alone). Stage 2 runs at learning rate 0,
  so "it started from stage 1's final weights" has an exact, independent check: its final weights
  are bit-equal to stage 1's final export (and those differ from the base model).
- During stage 2, ``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@N`` does before the
  time limit): the trainer checkpoints and exits 99, the job requeues itself, the requeued job
  resumes; every stage-2 step appears exactly once in metrics.jsonl.
- kill -9 of a training run (its process group) after a checkpoint, then resume through the
  NeMo-Run local executor: per-step metrics equal the uninterrupted Slurm run of stage 1 (same seed,
  one thread) within rel 1e-6 / abs 1e-8 (wall-clock timings and the weight-sync counter
  excluded), final weights within 1e-6, no
  checkpointed step redone, the same W&B run id.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.launch.conftest import (MINI_RECIPE, REPO, documented_command, local_cluster_block,
                                              read_metrics, run_state, trainer_env)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STAGE1, STAGE2 = "stage1_12", "stage2_16"
STAGE1_STEPS, STAGE2_STEPS = 3, 6
JOB_TIMEOUT_S = 600


def test_documented_local_cluster_commands_fit_the_local_cluster():
    """The block brings the cluster up and down around commands that fit its one node."""
    lines = local_cluster_block()
    assert lines[0].startswith("scripts/slurm_cluster.sh") and lines[-1].startswith("scripts/slurm_cluster.sh stop")
    sbatch = [line for line in lines if "sbatch" in line.split()]
    assert len(sbatch) == 2
    for line in sbatch:
        assert "--nodes=1" in line, f"the scripts ask for 4 nodes; the local cluster has one: {line}"
    (nemo,) = [line for line in lines if "launch.run" in line]
    assert "--nodes 1" in nemo and "--executor slurm" in nemo


def _sbatch(script: str, run_dir: Path, overrides: str = "") -> subprocess.Popen:
    """docs/recipe.md's ``sbatch --wait ... slurm/<script>`` in the background; it prints the job id first."""
    env = trainer_env(OVERRIDES=overrides, SBATCH_OUTPUT=f"{run_dir.parent}/slurm-%j.out",
                      SBATCH_TIMELIMIT="00:20:00")
    return subprocess.Popen(["bash", "-c", documented_command(f"slurm/{script}", run_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _job_id(line: str) -> str:
    m = re.search(r"Submitted batch job (\d+)", line)
    return m.group(1) if m else "?"


def _in_log(text: str, log: str) -> bool:
    """``text`` occurs in ``log`` up to white space (the console wraps long lines)."""
    return re.sub(r"\s+", "", text) in re.sub(r"\s+", "", log)


def _job_log(run_dir: Path, job_id: str) -> str:
    path = run_dir.parent / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _stage_rows(run_dir: Path, stage: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["stage"] == stage]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipe") / "run"


@pytest.fixture(scope="module")
def stage1(slurm_cluster, run_dir, kill9_resume):
    job = _sbatch("stage1_8k.sh", run_dir)
    out, err = job.communicate(timeout=JOB_TIMEOUT_S)
    job_id = _job_id(out)
    return {"rc": job.returncode, "job_id": job_id, "log": _job_log(run_dir, job_id), "stderr": err}


@pytest.fixture(scope="module")
def stage2(stage1, run_dir):
    assert stage1["rc"] == 0, f"stage 1 failed:\n{stage1['log'][-4000:]}"
    overrides = f"stages.1.lr=0.0 stages.1.max_steps={STAGE2_STEPS}"
    job = _sbatch("stage2_16k.sh", run_dir, overrides)
    first = job.stdout.readline()
    job_id = _job_id(first)
    assert job_id.isdigit(), f"sbatch printed {first!r}; stderr: {job.stderr.read() if job.poll() is not None else ''}"
    # Signal once the first stage-2 checkpoint exists: the trainer is then between or inside steps.
    try:
        _wait_for(run_dir / STAGE2 / "checkpoints" / "step_000001" / "trainer_state.json", job, JOB_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        job.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            subprocess.run(["scancel", job_id], timeout=30)
            job.kill()
            job.wait()
    return {"rc": job.returncode, "job_id": job_id, "log": _job_log(run_dir, job_id)}


def test_stage1_job_finishes_the_stage(stage1, run_dir):
    assert stage1["rc"] == 0, f"sbatch --wait returned {stage1['rc']}:\n{stage1['log'][-4000:]}"
    assert run_state(run_dir)["finished_stages"] == [STAGE1]
    assert [r["step"] for r in _stage_rows(run_dir, STAGE1)] == list(range(1, STAGE1_STEPS + 1))
    # The stage's result differs from the base model (the next stage has something to start from).
    final = _weights(run_dir / STAGE1 / "final" / "hf" / "model.safetensors")
    base = _weights(run_dir / "base_model" / "model.safetensors")
    assert final.keys() == base.keys()
    assert any(not (final[k] == base[k]).all() for k in final)


def test_stage2_starts_from_stage1_final_and_finishes(stage2, run_dir):
    assert stage2["rc"] == 0, f"sbatch --wait returned {stage2['rc']}:\n{stage2['log'][-4000:]}"
    assert run_state(run_dir)["finished_stages"] == [STAGE1, STAGE2]
    # Learning rate 0 in stage 2: its final weights are exactly what it started from.
    start = _weights(run_dir / STAGE1 / "final" / "hf" / "model.safetensors")
    end = _weights(run_dir / STAGE2 / "final" / "hf" / "model.safetensors")
    assert start.keys() == end.keys()
    for k in start:
        assert (start[k] == end[k]).all(), f"stage 2 did not start from stage 1's final weights ({k})"
    assert _in_log(f"starting from {run_dir / STAGE1 / 'final'}", stage2["log"])


def test_usr1_checkpoints_requeues_and_loses_or_repeats_no_step(stage2, run_dir):
    log = stage2["log"]
    assert stage2["rc"] == 0, log[-4000:]
    assert "got USR1" in log
    assert "trainer exited with 99" in log, log[-4000:]
    assert f"requeueing job {stage2['job_id']}" in log
    assert "(restart 1)" in log, "the job was not started a second time"
    steps = [r["step"] for r in _stage_rows(run_dir, STAGE2)]
    first = STAGE1_STEPS + 1
    assert steps == list(range(first, first + STAGE2_STEPS)), f"stage-2 steps logged: {steps}"
    # The requeued run resumed from a checkpoint of this stage, before the stage's end.
    assert _in_log(f"resuming from {run_dir / STAGE2 / 'checkpoints'}", log)
    final_state = (run_dir / STAGE2 / "final" / "trainer_state.json").read_text()
    assert f'"step": {STAGE2_STEPS}' in final_state


def _not_compared(key: str) -> bool:
    """Wall-clock metrics (they differ between any two runs), and the engine's weight version, which
    counts syncs: a resume adds one, to load the checkpoint into the fresh engine."""
    return (key in ("time", "sync/version") or key.startswith("timing/") or "seconds" in key
            or key.endswith(("time_s", "per_s")))


def _close(a, b, rel=1e-6, abs_=1e-8) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    return a == b


def _kill9_then_resume(other: Path, job_dir: Path) -> dict:
    """A training run of stage 1 outside Slurm, killed (-9, its process group) after its first
    checkpoint, then resumed through NeMo-Run's local executor: what the test compares."""
    env = trainer_env()
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(MINI_RECIPE),
           "--run-dir", str(other), "--stage", STAGE1]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_for(other / STAGE1 / "checkpoints" / "step_000001" / "trainer_state.json", proc, JOB_TIMEOUT_S)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its helpers (reward pool), no clean-up
        proc.wait()
    killed = {"rows": _stage_rows(other, STAGE1), "state": run_state(other),
              "checkpointed": max(int(p.name.split("_")[1]) for p in (other / STAGE1 / "checkpoints").iterdir()
                                  if (p / "trainer_state.json").exists())}
    killed["resume"] = subprocess.run(
        [sys.executable, "-m", "launch.run", "--stage", "1", "--executor", "local",
         "--config", str(MINI_RECIPE), "--run-dir", str(other), "--job-dir", str(job_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    return killed


@pytest.fixture(scope="module")
def kill9_resume(nemo_run_env, tmp_path_factory):
    """_kill9_then_resume, started before the Slurm jobs and run beside them: each trainer is
    single-threaded, so it takes the core a job leaves idle (the jobs' runs are the same alone)."""
    root = tmp_path_factory.mktemp("kill9")
    pool = ThreadPoolExecutor(1)
    future = pool.submit(_kill9_then_resume, root / "run", root / "nemo_run")
    yield root / "run", future
    pool.shutdown(wait=True)


def test_kill9_then_resume_with_nemo_run_local_matches_uninterrupted(stage1, run_dir, kill9_resume):
    assert stage1["rc"] == 0, stage1["log"][-4000:]
    other, future = kill9_resume
    killed = future.result(timeout=2 * JOB_TIMEOUT_S)
    killed_rows, checkpointed = killed["rows"], killed["checkpointed"]
    wandb_id = killed["state"].get("wandb_run_id")
    assert STAGE1 not in killed["state"]["finished_stages"]

    resume = killed["resume"]
    assert resume.returncode == 0, resume.stderr[-4000:]
    assert run_state(other)["finished_stages"] == [STAGE1]
    assert run_state(other).get("wandb_run_id") == wandb_id  # the resumed run continues the W&B run

    rows = _stage_rows(other, STAGE1)
    steps = [r["step"] for r in rows]
    assert len(killed_rows) >= checkpointed >= 1
    for s in range(1, checkpointed + 1):
        assert steps.count(s) == 1, f"step {s} was checkpointed before the kill but ran again: {steps}"
    last = {r["step"]: r for r in rows}  # a step the kill interrupted counts as run by the resume
    ref = {r["step"]: r for r in _stage_rows(run_dir, STAGE1)}
    assert sorted(last) == sorted(ref) == list(range(1, STAGE1_STEPS + 1))
    for s in ref:
        keys = {k for k in ref[s] if not _not_compared(k)}
        assert keys == {k for k in last[s] if not _not_compared(k)}
        diff = {k: (ref[s][k], last[s][k]) for k in keys if not _close(ref[s][k], last[s][k])}
        assert not diff, f"step {s}: resumed run differs from the uninterrupted one: {diff}"
    a = _weights(run_dir / STAGE1 / "final" / "hf" / "model.safetensors")
    b = _weights(other / STAGE1 / "final" / "hf" / "model.safetensors")
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k


def _job_fields(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout


def test_submit_recipe_chains_the_stages_with_afterok(slurm_cluster, tmp_path):
    """slurm/submit_recipe.sh submits stage 1, 2, 3 (held here, so nothing runs), each afterok the previous."""
    env = dict(os.environ, SIZE="32b", NODES="1", GPUS_PER_NODE="1", EXCLUSIVE="0", TIME="00:05:00",
               RUN_DIR=str(tmp_path / "run"), SBATCH_EXTRA=f"--hold --output={tmp_path}/slurm-%j.out")
    proc = subprocess.run(["bash", str(REPO / "slurm" / "submit_recipe.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    ids = proc.stdout.split()
    try:
        assert proc.returncode == 0, proc.stderr
        assert len(ids) == 3 and all(i.isdigit() for i in ids), proc.stdout
        fields = [_job_fields(i) for i in ids]
        scripts = ["stage1_8k.sh", "stage2_16k.sh", "stage3_32k.sh"]
        for i, f in enumerate(fields):
            assert f"Command={REPO / 'slurm' / scripts[i]}" in f
            assert "JobState=PENDING" in f
            assert "Requeue=1" in f
            if i == 0:
                assert "Dependency=(null)" in f
            else:
                assert f"Dependency=afterok:{ids[i - 1]}" in f, f
    finally:
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
