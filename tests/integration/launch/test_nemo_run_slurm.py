"""NeMo-Run's Slurm executor for real: docs/recipe.md's ``launch.run --stage 1,2 --executor slurm``
command, as written (the miniature's config, the test's run dir), submits two chained jobs to the
local one-node cluster through NeMo-Run's local tunnel.

Checked: the launcher returns after submitting; stage 2's job waits on stage 1's (afterok) and
starts after it ended; both jobs run their stage to the end; stage 2 starts from stage 1's final
checkpoint; each job's logs land where docs/recipe.md and README say
($NEMORUN_HOME/experiments/<experiment>/<experiment>_<id>/<stage>/), with undoubled paths.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.launch.conftest import REPO, documented_command, run_state, trainer_env

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STAGES = ["stage1_12", "stage2_16"]
JOB_TIMEOUT_S = 600


def _job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))


def _states(job_ids: list[str]) -> dict[str, str]:
    """job id -> state of those still in the queue."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)], capture_output=True, text=True)
    return {i: st for i, st in (ln.split() for ln in out.stdout.splitlines() if ln.strip()) if i in job_ids}


@pytest.fixture(scope="module")
def submitted(slurm_cluster, nemo_run_env, tmp_path_factory):
    base = tmp_path_factory.mktemp("nemo_slurm")
    run_dir = base / "run"
    cmd = documented_command("launch.run", base / "unused", nemo_run_dir=run_dir)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                          timeout=300)
    submit_s = time.monotonic() - t0
    found = re.findall(r"launch: (\S+): submitted as Slurm job (\d+); logs in (\S+)", proc.stderr)
    jobs = {stage: (job_id, Path(logs)) for stage, job_id, logs in found}
    ids = [jobs[s][0] for s in STAGES if s in jobs]
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert sorted(jobs) == sorted(STAGES), proc.stderr[-4000:]
        # Right after submission stage 2 waits on stage 1 (stage 1 takes far longer than this).
        pending = _job_fields(jobs[STAGES[1]][0])
        timeline = []  # the queue's states of (stage 1, stage 2), sampled until both have left it
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while states := _states(ids):
            timeline.append(tuple(states.get(i, "GONE") for i in ids))
            assert time.monotonic() < deadline, f"jobs {ids} still queued after {JOB_TIMEOUT_S} s"
            time.sleep(0.5)
    finally:
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
    return {"run_dir": run_dir, "jobs": jobs, "pending": pending, "timeline": timeline, "submit_s": submit_s,
            "home": Path(nemo_run_env)}


def test_stage2_job_depends_on_stage1_and_starts_after_it(submitted):
    (id1, _), (id2, _) = (submitted["jobs"][s] for s in STAGES)
    assert submitted["pending"].get("Dependency", "").startswith(f"afterok:{id1}"), submitted["pending"]
    timeline = submitted["timeline"]
    # Stage 2 pends while stage 1 is queued or running, and runs only once stage 1 has left the queue.
    assert all(s2 == "PENDING" for s1, s2 in timeline if s1 != "GONE"), timeline
    assert ("RUNNING", "PENDING") in timeline and ("GONE", "RUNNING") in timeline, timeline
    assert submitted["submit_s"] < 120  # it submitted and returned; it did not wait for the jobs


def test_both_stages_ran_and_stage2_started_from_stage1_final(submitted):
    run_dir = submitted["run_dir"]
    assert run_state(run_dir)["finished_stages"] == STAGES
    log2 = re.sub(r"\x1b\[[0-9;]*m|\s+", "", _log(submitted, STAGES[1]).read_text(errors="replace"))
    assert re.sub(r"\s+", "", f"starting from {run_dir / STAGES[0] / 'final'}") in log2


def _log(submitted, stage: str) -> Path:
    job_id, logs = submitted["jobs"][stage]
    return logs / f"log-mrl-{stage}_{job_id}_0.out"


def test_logs_land_where_the_docs_say(submitted):
    home = submitted["home"]
    for stage in STAGES:
        job_id, logs = submitted["jobs"][stage]
        # $NEMORUN_HOME/experiments/<experiment>/<experiment>_<id>/<stage>/
        rel = logs.relative_to(home / "experiments")
        experiment, exp_id, leaf = rel.parts
        assert leaf == stage and exp_id.startswith(experiment + "_") and experiment == "mrl-7b-" + "-".join(STAGES)
        trainer_log = _log(submitted, stage)
        assert "trainer exited with 0" in trainer_log.read_text(errors="replace")
        batch_log = logs / f"sbatch_mrl-{stage}_{job_id}.out"
        assert "job exited with code 0" in batch_log.read_text(errors="replace")
        script = (logs.parent / f"{stage}_sbatch.sh").read_text()
        out_line = next(ln for ln in script.splitlines() if ln.startswith("#SBATCH --output="))
        assert out_line == f"#SBATCH --output={logs}/sbatch_mrl-{stage}_%j.out"  # one path, not doubled
        assert f"--chdir {logs}/code " in script and (logs / "code").is_dir()
