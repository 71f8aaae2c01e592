"""Fixtures of the launch tests: a real one-node Slurm cluster, NeMo-Run, the CPU miniature's env."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
MINI_RECIPE = Path(__file__).resolve().parent / "mini_recipe.yaml"

# Exit code of scripts/slurm_cluster.sh when apt-get cannot reach a Debian mirror.
APT_UNREACHABLE = 3


def _cluster_up() -> bool:
    return subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def slurm_cluster():
    """Bring the local Slurm cluster up with scripts/slurm_cluster.sh; stop it afterwards if we started it."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (apt-get, /etc/slurm, daemons)")
    was_up = _cluster_up()
    proc = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode == APT_UNREACHABLE:
        pytest.skip(f"apt cannot install slurm/munge here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, f"scripts/slurm_cluster.sh start failed:\n{proc.stderr}"
    yield
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def nemo_run_env(tmp_path_factory):
    """NeMo-Run importable (installed by launch/install.sh if missing) and NEMORUN_HOME set."""
    if importlib.util.find_spec("nemo_run") is None:
        proc = subprocess.run(["bash", str(REPO / "launch" / "install.sh"), sys.executable],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"launch/install.sh failed:\n{proc.stdout}\n{proc.stderr}"
    home = tmp_path_factory.mktemp("nemorun_home")
    old = os.environ.get("NEMORUN_HOME")
    os.environ["NEMORUN_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("NEMORUN_HOME", None)
    else:
        os.environ["NEMORUN_HOME"] = old


def trainer_env(**extra: str) -> dict[str, str]:
    """Environment of a CPU-miniature trainer process: deterministic (one thread), offline."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONWARNINGS": "ignore",
        "VENV": sys.prefix,
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
    })
    env.update(extra)
    return env


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


RECIPE_DOC = REPO / "docs" / "recipe.md"
LOCAL_CLUSTER_HEADING = "### On this machine"


def local_cluster_block() -> list[str]:
    """The command lines of docs/recipe.md's local-cluster block (continuation lines joined)."""
    text = RECIPE_DOC.read_text()
    assert LOCAL_CLUSTER_HEADING in text, f"{RECIPE_DOC} lost its heading {LOCAL_CLUSTER_HEADING!r}"
    section = text[text.index(LOCAL_CLUSTER_HEADING):]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines, pending = [], ""
    for raw in block.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1]
            continue
        lines.append(pending + raw)
        pending = ""
    return [ln for ln in lines if ln.strip()]


def documented_command(needle: str, run_dir: Path, nemo_run_dir: Path | None = None) -> str:
    """A bash script of the documented local-cluster command containing ``needle``, as written,
    preceded by the block's ``export`` line; only the demo config becomes the test's miniature and
    the run directories the test's."""
    lines = local_cluster_block()
    exports = [ln for ln in lines if ln.startswith("export ")]
    (cmd,) = [ln for ln in lines if needle in ln]
    script = "\n".join(["set -e", *exports, cmd])
    script = script.replace("configs/demo_cpu.yaml", str(MINI_RECIPE))
    if nemo_run_dir is not None:
        script = script.replace("$PWD/runs/demo-nemo", str(nemo_run_dir))
    return script.replace("$PWD/runs/demo", str(run_dir))
