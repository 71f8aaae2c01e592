"""NeMo-Run launcher: the sbatch script generated for a 2-node Slurm executor (no cluster needed).

The script is parsed (``#SBATCH`` lines, the srun line, the torchrun arguments) and checked against
the request: nodes, GPUs, container, mounts, signal, requeue budget and the trainer command.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.integration.launch.conftest import REPO

pytestmark = pytest.mark.slow


def _sbatch_directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line.strip())
        if m:
            out[m.group(1)] = m.group(2) if m.group(2) is not None else ""
    return out


def _srun_line(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.lstrip().startswith("srun ") and "node_launch.sh" in ln]
    assert len(lines) == 1, f"expected one srun line running node_launch.sh, got {lines}"
    # $head_node_ip / $SLURM_JOB_ID must stay unexpanded for the batch shell: split without expanding.
    return shlex.split(lines[0])


def _option(argv: list[str], name: str) -> str:
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return argv[i + 1]
    raise AssertionError(f"{name} not in {argv}")


@pytest.fixture(scope="module")
def dry_run_text(nemo_run_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run7b")
    cmd = [sys.executable, "-m", "launch.run", "--stage", "stage2", "--executor", "slurm", "--dry-run",
           "--nodes", "2", "--gpus-per-node", "8", "--account", "acct", "--partition", "batch",
           "--time", "04:00:00", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3",
           "--container-mount", "/lustre/data:/data", "--env", "WANDB_MODE=online",
           "--run-dir", str(run_dir), "rollout.temperature=0.9"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout[proc.stdout.index("#!/bin/bash"):]
    return text, run_dir


def test_sbatch_resources(dry_run_text):
    text, _ = dry_run_text
    d = _sbatch_directives(text)
    assert d["nodes"] == "2"
    assert d["gpus-per-node"] == "8"
    assert d["ntasks-per-node"] == "1"  # one node_launch.sh (-> torchrun) per node
    assert d["account"] == "acct" and d["partition"] == "batch"
    assert d["time"] == "04:00:00"
    # No Slurm signal (it would reach every process of the step); node_launch.sh watches the time
    # left and asks the trainer to checkpoint 900 s (stage 2) before the limit.
    assert "signal" not in d
    assert "export MRL_STOP_BEFORE_END_S=900" in text
    assert "exclusive" in d
    # Requeue: submitted with --requeue, and NeMo-Run's script requeues up to max_requeues times.
    assert "sbatch --requeue" in text
    assert "export TORCHX_MAX_RETRIES=50" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


def test_container_and_env(dry_run_text):
    text, run_dir = dry_run_text
    argv = _srun_line(text)
    assert _option(argv, "--container-image") == "nvcr.io/nvidia/pytorch:25.01-py3"
    mounts = _option(argv, "--container-mounts").split(",")
    # The checkout and the run directory's parent at the same paths, then the user's mount.
    assert f"{REPO}:{REPO}" in mounts
    assert f"{run_dir.parent}:{run_dir.parent}" in mounts
    assert "/lustre/data:/data" in mounts
    assert f"export MEGATRON_RL_HOME={REPO}" in text
    assert "export LAUNCHER=torchrun" in text
    assert "export WANDB_MODE=online" in text


def test_torchrun_arguments(dry_run_text):
    text, run_dir = dry_run_text
    argv = _srun_line(text)
    i = argv.index(str(REPO / "slurm" / "node_launch.sh"))
    node_cmd = argv[i + 1:]
    assert node_cmd[0] == "torchrun"
    assert _option(node_cmd, "--nnodes") == "2"
    assert _option(node_cmd, "--nproc-per-node") == "8"
    assert _option(node_cmd, "--rdzv-backend") == "c10d"
    assert _option(node_cmd, "--rdzv-endpoint") == "$head_node_ip:$((20000+SLURM_JOB_ID%20000))"
    assert _option(node_cmd, "--max-restarts") == "0"
    j = node_cmd.index("-m")
    assert node_cmd[j + 1:j + 3] == ["megatron_rl.cli", "train"]
    train = node_cmd[j + 2:]
    assert _option(train, "--config") == str(REPO / "configs/skywork_or1/7b/stage2.yaml")
    assert _option(train, "--stage") == "stage2_16k"  # the 2nd stage of that config
    assert _option(train, "--run-dir") == str(run_dir)
    assert train[-1] == "rollout.temperature=0.9"


def test_bad_request_names_the_field(nemo_run_env):
    from launch.config import LaunchConfig
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="stage"):
        LaunchConfig(stage=4).validate()
    with pytest.raises(ConfigError, match="nodes"):
        LaunchConfig(stage=1, executor="local", nodes=2).validate()
    with pytest.raises(ConfigError, match="container_mounts"):
        LaunchConfig(stage=1, container_mounts=["/no-colon"]).validate()
    with pytest.raises(ConfigError, match="config"):
        LaunchConfig(stage=1, config="configs/nope.yaml").validate()


def test_documented_dry_run_has_undoubled_paths(nemo_run_env):
    """docs/recipe.md's dry-run command, as written: the log and working-directory paths are one
    path each under $NEMORUN_HOME/experiments (NeMo-Run once doubled a path containing /nemo_run)."""
    doc = (REPO / "docs" / "recipe.md").read_text()
    (line,) = [ln for ln in doc.splitlines() if ln.startswith("python -m launch.run") and "--dry-run" in ln]
    argv = shlex.split(line.split("#")[0])
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout[proc.stdout.index("#!/bin/bash"):]
    out = _sbatch_directives(text)["output"]
    srun = _srun_line(text)
    chdir, log = _option(srun, "--chdir"), _option(srun, "--output")
    exp_root = f"{nemo_run_env}/experiments/"
    for path in (out, chdir, log):
        assert path.startswith(exp_root) and path.count(exp_root) == 1, path
    job_dir = out.rsplit("/", 1)[0]
    assert chdir == f"{job_dir}/code" and log.rsplit("/", 1)[0] == job_dir


def test_paths_nemo_run_would_mangle_are_refused(nemo_run_env, tmp_path):
    bad = tmp_path / "nemo_run" / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.run", "--stage", "1", "--executor", "slurm", "--dry-run",
                           "--run-dir", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "run_dir" in proc.stderr and "/nemo_run" in proc.stderr, proc.stderr[-2000:]
