"""The launch scripts check their environment first: every variable each `slurm/` script reads is
checked for its type (a whole number, one of the choices, an existing directory or virtualenv, host
names) before any is used, and one that cannot work is one line, `megatron-rl: NAME ...`, exit 2
(never bash's "unbound variable" or "No such file or directory", never a node launcher that goes
on and reports success). A layout the job cannot run is refused the same way before anything is
printed or submitted: NeMo-Run's launcher checks the trainer's TP x PP x CP against nodes x
processes per node, processes against GPUs, the engines against a node's GPUs; the stage scripts
check it against their allocation (or NPROC_PER_NODE)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.unit.test_entry_point_errors import DEMO, REPO, check_one_line, run_all

SLURM = REPO / "slurm"
VENV = str(Path(sys.executable).parents[1])


def test_launch_scripts_check_every_variable_first(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("sbatch", "srun"):  # nothing may be submitted or started
        (fake / tool).write_text(f"#!/bin/sh\necho '{tool} was called' >&2\nexit 7\n")
        (fake / tool).chmod(0o755)
    (tmp_path / "a_file").write_text("x")
    broken = tmp_path / "broken_python"  # a python without megatron-rl's dependencies
    broken.mkdir()
    (broken / "python").write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                                   "echo \"ModuleNotFoundError: No module named 'yaml'\" >&2\nexit 1\n")
    (broken / "python").chmod(0o755)
    base = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "VENV": VENV, "DRY_RUN": "1",
            "MEGATRON_RL_HOME": str(REPO)}
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "OVERRIDES", "NPROC_PER_NODE", "LAUNCHER"):
        base.pop(name, None)
    stage = ["bash", str(SLURM / "stage1_8k.sh")]
    node = ["bash", str(SLURM / "node_launch.sh"), "python", "-c", "print('trainer ran')"]
    submit = ["bash", str(SLURM / "submit_recipe.sh")]
    cases = {
        "ROLLOUT_NODES=two": (stage, {"ROLLOUT_PLACEMENT": "dedicated", "ROLLOUT_NODES": "two"},
                              ("ROLLOUT_NODES must be a whole number >= 1, got 'two'",)),
        "stage VENV missing": (stage, {"VENV": str(tmp_path / "no_venv")}, ("VENV: no such virtualenv directory",)),
        "stage VENV no venv": (stage, {"VENV": str(tmp_path)}, ("VENV:", "is not a virtualenv")),
        "NPROC_PER_NODE": (stage, {"NPROC_PER_NODE": "eight"}, ("NPROC_PER_NODE must be a whole number",)),
        "MASTER_PORT": (stage, {"MASTER_PORT": "70000"}, ("MASTER_PORT must be >= 1 and <= 65535, got 70000",)),
        "LAUNCHER": (stage, {"LAUNCHER": "mpirun"}, ("LAUNCHER must be torchrun or direct, got 'mpirun'",)),
        "DRY_RUN": (stage, {"DRY_RUN": "yes"}, ("DRY_RUN must be 0 or 1",)),
        "MAX_REQUEUES": (stage, {"MAX_REQUEUES": "-1"}, ("MAX_REQUEUES must be a whole number >= 0",)),
        "ROLLOUT_HOSTS": (stage, {"ROLLOUT_PLACEMENT": "dedicated", "ROLLOUT_HOSTS": "n1;reboot"},
                          ("ROLLOUT_HOSTS must be host names",)),
        "CONTAINER_MOUNTS": (stage, {"CONTAINER_MOUNTS": "/data"}, ("CONTAINER_MOUNTS must be src:dst",)),
        "MODEL_PATH": (stage, {"MODEL_PATH": str(tmp_path / "no_model")}, ("MODEL_PATH: no such directory",)),
        "RUN_DIR a file": (stage, {"RUN_DIR": str(tmp_path / "a_file")}, ("RUN_DIR: cannot be a directory",)),
        "RUN_DIR under a file": (stage, {"RUN_DIR": str(tmp_path / "a_file" / "run")},
                                 ("RUN_DIR: cannot be a directory:", "a_file is a file")),
        "trainer.run_dir under a file": (stage, {"DRY_RUN": "0", "OVERRIDES": f"trainer.run_dir={tmp_path}/a_file/r"},
                                         ("cannot create the run directory", "a_file/r (RUN_DIR, else the config's trainer.run_dir)")),
        "submit RUN_DIR": (submit, {"RUN_DIR": str(tmp_path / "a_file" / "run")}, ("RUN_DIR: cannot be a directory",)),
        "MEGATRON_RL_HOME": (stage, {"MEGATRON_RL_HOME": str(tmp_path / "nowhere")},
                             ("MEGATRON_RL_HOME: no megatron-rl checkout",)),
        "SLURM_JOB_ID": (stage, {"SLURM_JOB_ID": "12a"}, ("SLURM_JOB_ID must be a whole number",)),
        "layout vs NPROC_PER_NODE": (stage, {"NPROC_PER_NODE": "2"}, (
            "'policy.parallel.tensor_parallel'", "4 ranks needed but only 2", "1 trainer node(s) x 2 process(es)")),
        "python without the dependencies": (stage, {"VENV": "", "PATH": f"{broken}:{fake}:/usr/bin:/bin"}, (
            "cannot run megatron_rl.tools.job_config (set VENV", "No module named 'yaml'")),
        "node VENV missing": (node, {"VENV": str(tmp_path / "no_venv")}, ("VENV: no such virtualenv directory",)),
        "node LAUNCHER": (node, {"LAUNCHER": "srun"}, ("LAUNCHER must be torchrun or direct",)),
        "node MRL_STOP_BEFORE_END_S": (node, {"MRL_STOP_BEFORE_END_S": "soon"}, ("MRL_STOP_BEFORE_END_S must be",)),
        "node RESEND_SECONDS": (node, {"RESEND_SECONDS": "0"}, ("RESEND_SECONDS must be a number > 0",)),
        "node MRL_ENGINE_ARGS": (node, {"MRL_ENGINE_ARGS": "engines --config 'unclosed"},
                                 ("MRL_ENGINE_ARGS is not a list of shell words",)),
        "node MRL_STOP_FILE": (node, {"MRL_STOP_FILE": str(tmp_path / "no_dir" / "stop")},
                               ("MRL_STOP_FILE: its directory does not exist",)),
        "node MEGATRON_RL_HOME": (node, {"MEGATRON_RL_HOME": str(tmp_path / "nowhere")},
                                  ("MEGATRON_RL_HOME: no such checkout directory",)),
        "SIZE": (submit, {"SIZE": "13b"}, ("SIZE must be 7b or 32b or 30b_a3b, got '13b'",)),
        "NODES": (submit, {"NODES": "two"}, ("NODES must be a whole number >= 1",)),
        "GPUS_PER_NODE": (submit, {"GPUS_PER_NODE": "0"}, ("GPUS_PER_NODE must be >= 1, got 0",)),
        "FIRST_STAGE": (submit, {"FIRST_STAGE": "4"}, ("FIRST_STAGE must be >= 1 and <= 3, got 4",)),
        "stages reversed": (submit, {"FIRST_STAGE": "3", "LAST_STAGE": "1"}, ("FIRST_STAGE (3) is after LAST_STAGE (1)",)),
        "TIME": (submit, {"TIME": "two days"}, ("TIME must be a Slurm time limit",)),
        "AFTER": (submit, {"AFTER": "job-12"}, ("AFTER must be Slurm job ids",)),
        "EXCLUSIVE": (submit, {"EXCLUSIVE": "yes"}, ("EXCLUSIVE must be 0 or 1",)),
        "CONFIG_DIR": (submit, {"CONFIG_DIR": str(tmp_path / "none")}, ("CONFIG_DIR: no such config directory",)),
        "submit VENV": (submit, {"VENV": str(tmp_path / "no_venv")}, ("VENV: no such virtualenv directory",)),
    }
    results = run_all(cases, tmp_path, base)
    wrong = {}
    for name, (code, out, err) in results.items():
        try:
            assert "was called" not in err and "trainer ran" not in out, (out, err)
            check_one_line(code, out, err, *cases[name][2])
            assert "unbound variable" not in err and "No such file" not in err
        except AssertionError as exc:
            wrong[name] = f"{exc}"[:500]
    assert not wrong, f"{sorted(wrong)} {wrong}"


# Variables the scripts read without a type of their own to check, and why.
FREE_FORM = {
    "BASH_SOURCE": "bash's", "PWD": "the shell's", "SECONDS": "the shell's", "PYTHONPATH": "passed on",
    "CONFIG": "the file is checked where it is resolved", "STAGE": "checked with the config (a stage name)",
    "OVERRIDES": "checked with the config (megatron_rl.tools.job_config)", "DEFAULT_CONFIG": "set by the stage script",
    "CONTAINER": "an image name, pyxis's to find", "PARTITION": "sbatch's to check", "ACCOUNT": "sbatch's to check",
    "SBATCH_EXTRA": "sbatch flags, sbatch's to check", "SLURM_JOB_NODELIST": "Slurm's (scontrol expands it)",
    "SLURM_SUBMIT_DIR": "Slurm's", "SLURMD_NODENAME": "Slurm's", "MRL_STOP_FILE": "common.sh sets it (node_launch checks its dir)",
}


@pytest.mark.parametrize("script", ["common.sh", "node_launch.sh", "submit_recipe.sh", "stage1_8k.sh",
                                    "stage2_16k.sh", "stage3_32k.sh"])
def test_launch_scripts_every_variable_read_is_checked(script):
    """The walk: each upper-case variable a script reads is checked in it (or is free-form, above)."""
    text = (SLURM / script).read_text()
    code = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    read = set(re.findall(r"\$\{?!?([A-Z][A-Z0-9_]*)", code))
    if script.startswith("stage"):  # they check MEGATRON_RL_HOME (SLURM_JOB_ID: common.sh's check)
        read -= {"SLURM_JOB_ID"}
    checked = set(re.findall(r"mrl_need_\w+ ([A-Z][A-Z0-9_]*)", code)) | set(
        re.findall(r"_mrl_refuse \"([A-Z][A-Z0-9_]*)", code)) | set(re.findall(r"megatron-rl: ([A-Z][A-Z0-9_]*)", code))
    checked |= {"VENV"} if "mrl_need_venv" in code else set()
    checked |= set(re.findall(r"for name in ([A-Z_ ]+);", code)[0].split()) if "for name in" in code else set()
    assert not read - checked - set(FREE_FORM), f"{script} reads unchecked: {sorted(read - checked - set(FREE_FORM))}"


@pytest.mark.parametrize("argv,says", [
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "1", "--gpus-per-node", "2"],
     ("'policy.parallel.tensor_parallel'", "4 ranks needed but only 2", "--nodes (1) x --gpus-per-node (2)")),
    (["--stage", "3", "--size", "32b", "--executor", "slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "4"],
     ("x context_parallel (2) = 32 ranks needed but only 8",)),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "1", "--gpus-per-node", "6"],
     ("4 does not divide the world size 6",)),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "4",
      "--nproc-per-node", "8"], ("'nproc_per_node'", "8 trainer processes per node", "--gpus-per-node is 4")),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "1", "--gpus-per-node", "4"],
     ("'rollout.engines_per_node'", "8 engines x rollout.tensor_parallel_size 1 = 8 GPUs per node")),
    (["--stage", "1", "--executor", "local", "--dry-run", "--config", DEMO, "policy.parallel.context_parallel=2"],
     ("'policy.parallel.context_parallel'", "rollout.engine='vllm'")),
    (["--stage", "1", "--executor", "local", "--dry-run", "--config", DEMO, "--nproc-per-node", "2"],
     ("'rollout.engine'", "--nodes (1) x --nproc-per-node (2)=2")),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "4", "--time", "two days"],
     ("'time'", "must be a Slurm time limit", "'two days'")),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "4", "--venv", "/no/venv"],
     ("'venv'", "no virtualenv at '/no/venv'")),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "4", "--job-dir", "TMP/a_file/jobs"],
     ("'job_dir'", "cannot create the directory", "a_file/jobs: Not a directory")),
    (["--stage", "1", "--executor", "slurm", "--dry-run", "--nodes", "4", "--run-dir", "TMP/a_file/run"],
     ("'run_dir'", "cannot create the directory", "a_file/run/nemorun: Not a directory")),
    (["--stage", "1", "--executor", "local", "--config", DEMO, "--run-dir", "TMP/a_file/run", "--job-dir", "TMP/jobs"],
     ("'run_dir'", "cannot create the directory", "a_file/run: Not a directory")),
    (["--stage", "2,1", "--executor", "slurm", "--dry-run", "--nodes", "4"],
     ("--stage: chained stages run in order, each once", "'2,1'")),
    (["--stage", "1,1", "--executor", "slurm", "--dry-run", "--nodes", "4"], ("each once", "'1,1'")),
])
def test_launch_run_checks_the_layout_before_it_prints(capsys, monkeypatch, tmp_path, argv, says):
    from launch.run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NEMORUN_HOME", raising=False)
    (tmp_path / "a_file").write_text("")  # where a directory should be
    code = main([a.replace("TMP", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    check_one_line(code, out, err, *says)
    assert "#SBATCH" not in out and out.strip() == ""


@pytest.mark.parametrize("argv,env,says", [
    (["--count", "0"], {}, "engines: --count must be >= 1, got 0"),
    (["--node-name", "../n1"], {}, "the node name '../n1' (--node-name, else $MRL_NODE_NAME)"),
    ([], {"MRL_NODE_NAME": "n 1"}, "the node name 'n 1'"),
    (["--host", "a b"], {}, "the host 'a b' (--host, else $MRL_NODE_HOST)"),
])
def test_launch_the_node_launcher_checks_its_own_inputs(capsys, monkeypatch, argv, env, says):
    """`megatron-rl engines` (each node's launcher of vLLM servers): one line, exit 2, nothing started."""
    from megatron_rl.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main(["engines", "--config", DEMO, "rollout.engine=vllm_server", "sync.transport=gloo", *argv])
    out, err = capsys.readouterr()
    check_one_line(code, out, err, says)


@pytest.mark.parametrize("argv,says", [
    (["train", "--config", DEMO, "--run-dir", "TMP/a_file/run"],
     ("'trainer.run_dir'", "cannot create the run directory", "a_file/run: Not a directory")),
    (["train", "--config", DEMO, "--run-dir", "TMP/a_file"], ("'trainer.run_dir'", "a_file is a file, not a directory")),
    (["engines", "--config", DEMO, "rollout.engine=vllm_server", "sync.transport=gloo", "rollout.start_timeout_s=1",
      "--run-dir", "TMP/a_file/run"],
     ("'trainer.run_dir'", "a_file/run: Not a directory")),
    (["engines", "--config", DEMO, "rollout.engine=vllm_server", "sync.transport=gloo", "rollout.start_timeout_s=1",
      "rollout.registry_dir=TMP/a_file/engines", "--run-dir", "TMP/run"],
     ("'rollout.registry_dir'", "cannot create the engine registry", "a_file/engines: Not a directory")),
])
def test_launch_a_run_dir_that_cannot_be_made_is_one_line_before_anything_starts(capsys, tmp_path, argv, says):
    """The trainer and the node launcher make their directories first (the trainer: before its
    world starts; the launcher: before it waits for the model or starts a server; start_timeout_s=1
    bounds that wait were the check missing)."""
    from megatron_rl.cli import main

    (tmp_path / "a_file").write_text("")  # where a directory should be
    code = main([a.replace("TMP", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    check_one_line(code, out, err, *says)
