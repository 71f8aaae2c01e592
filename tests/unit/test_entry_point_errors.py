"""Every entry point reports a bad config key (or command line) the same way: one line on stderr,
``megatron-rl: <message naming the key>``, exit status 2, no traceback, before anything runs or is
submitted. The Python entry points run in process (``megatron-rl`` and its subcommands,
``python -m launch.run``, the job scripts' config check, the benchmark that takes config overrides);
the shell entry points (``slurm/stage*.sh``, ``slurm/submit_recipe.sh``, ``slurm/node_launch.sh``)
as the user runs them, all at once."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.common.cli_args import run_main

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo_cpu.yaml")
BAD = "rollout.temprature=1"
SAYS = ("config key 'rollout.temprature' on the command line", "unknown key")


def check_one_line(code: int, stdout: str, stderr: str, *expected: str) -> str:
    assert code == 2, (code, stderr[-2000:])
    assert "Traceback" not in stderr and "megatron-rl:" not in stdout, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megatron-rl: "), stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def run_all(cases: dict, cwd: Path, env: dict) -> dict:
    """Every case ``name -> (command, extra environment, _)`` at once; name -> (exit status, stdout, stderr)."""
    procs = {name: subprocess.Popen(cmd, cwd=cwd, env={**env, **extra}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (cmd, extra, _) in cases.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def _launch(argv):
    from launch.run import main

    return main(argv)


def _job_config(argv):
    from megatron_rl.tools.job_config import main

    return main(argv)


def _benchmark(argv, monkeypatch, name="async_speedup"):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return run_main(mod.main)


def _distillation_benchmark(argv, monkeypatch):
    return _benchmark(argv, monkeypatch, "distillation")


def _cli(argv):
    from megatron_rl.cli import main

    return main(argv)


@pytest.mark.parametrize("entry,argv,says", [
    (_cli, ["train", "--config", DEMO, BAD], SAYS),
    (_cli, ["demo", "--run-dir", "unused", BAD], SAYS),
    (_cli, ["engines", "--config", DEMO, BAD], SAYS),
    (_cli, ["data", "difficulty", "--data", DEMO, "--model", "m", "--out", "o.jsonl", "rollout.temprature=1"], SAYS),
    (_cli, ["train"], ("train: the following arguments are required: --config",)),
    (_launch, ["--stage", "1", "--executor", "local", "--dry-run", "--config", DEMO, BAD], SAYS),
    (_launch, ["--stage", "1", "--executor", "local", "--dry-run", "--config", DEMO, "--stage-name", "s9"],
     ("no stage named 's9'",)),
    (_launch, ["--stage", "x"], ("launch: --stage must be stage1",)),
    (_launch, ["--executor", "cloud", "--stage", "1"], ("launch: argument --executor: invalid choice: 'cloud'",)),
    (_job_config, ["--config", DEMO, "--index", "1", BAD], SAYS),
    (_job_config, ["--config", DEMO, "--index", "9"], ("'stages'", DEMO, "no stage number 9")),
    (_benchmark, ["--algo", BAD], SAYS),
    (_benchmark, ["--steps", "x"], ("async_speedup: argument --steps: invalid int value",)),
    (_distillation_benchmark, ["--work", "unused", "--distill-override", BAD], SAYS),
], ids=lambda v: v.__name__.strip("_") if callable(v) else None)
def test_python_entry_points(capsys, monkeypatch, tmp_path, entry, argv, says):
    monkeypatch.chdir(tmp_path)
    code = entry(argv, monkeypatch) if entry in (_benchmark, _distillation_benchmark) else entry(argv)
    out, err = capsys.readouterr()
    check_one_line(code, out, err, *says)


def test_shell_entry_points(tmp_path):
    """The stage scripts and the recipe's submitter check the config with the job's overrides
    before srun / sbatch (a stand-in sbatch on PATH shows nothing was submitted)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\necho 'sbatch was called' >&2\nexit 7\n")
    (fake / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "VENV": str(Path(sys.executable).parents[1]),
           "OVERRIDES": BAD, "DRY_RUN": "1", "MEGATRON_RL_HOME": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_JOB_NODELIST", None)
    cases = {
        "stage1_8k.sh": (["bash", str(REPO / "slurm" / "stage1_8k.sh")], {}, SAYS),
        "stage3_32k.sh dedicated": (["bash", str(REPO / "slurm" / "stage3_32k.sh")],
                                    {"ROLLOUT_PLACEMENT": "dedicated"}, SAYS),
        "submit_recipe.sh": (["bash", str(REPO / "slurm" / "submit_recipe.sh")], {}, SAYS),
        "stage2_16k.sh bad placement": (["bash", str(REPO / "slurm" / "stage2_16k.sh")],
                                        {"OVERRIDES": "", "ROLLOUT_PLACEMENT": "elsewhere"},
                                        ("ROLLOUT_PLACEMENT must be colocated or dedicated",)),
        "node_launch.sh": (["bash", str(REPO / "slurm" / "node_launch.sh")], {}, ("node_launch.sh: usage",)),
    }
    wrong = {}
    for name, (code, out, err) in run_all(cases, tmp_path, env).items():
        try:
            assert "sbatch was called" not in err
            check_one_line(code, out, err, *cases[name][2])
        except AssertionError as exc:
            wrong[name] = f"{exc}"[:600]
    assert not wrong, f"{sorted(wrong)} {wrong}"
