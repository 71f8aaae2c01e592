"""A multi-rank launch made by hand (or a launcher set up wrong) gets the project's one line, exit 2:
every torch.distributed variable is checked before the world starts (common/launch_env.py), and
torch's own rendezvous failures (a port already taken, ranks that never come) are said the same way.

The checks run in process on the real entry point (``megatron-rl demo``); the rendezvous failures
run the real command in child processes, against real sockets and torch's real store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megatron_rl.cli import main
from megatron_rl.common.launch_env import LaunchEnvError, check_device, rank_hint, read_launch_env
from tests.unit.test_entry_point_errors import REPO, check_one_line
from tests.unit.trainer.test_no_hang_layouts import SERVERS

TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_torchrun_sets_is_read():
    env = read_launch_env(TORCHRUN)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (2, 1, 1, 2)
    assert (env.master_addr, env.master_port, env.rendezvous) == ("127.0.0.1", 29500, True)
    alone = read_launch_env({})
    assert (alone.world_size, alone.rank, alone.local_rank, alone.rendezvous) == (1, 0, 0, False)
    assert read_launch_env({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "localhost"}).rendezvous is False


def _without(*names):
    return {k: v for k, v in TORCHRUN.items() if k not in names}


# (environment, what the line must say): each class of mistake, with further cases of each
CASES = {
    # the rendezvous address missing in a world of several processes
    "no MASTER_ADDR/PORT": (_without("MASTER_ADDR", "MASTER_PORT"),
                            ("WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set", "launch with torchrun")),
    "no MASTER_PORT": (_without("MASTER_PORT"), ("WORLD_SIZE=2 but MASTER_PORT is not set",)),
    "no MASTER_ADDR": (_without("MASTER_ADDR"), ("WORLD_SIZE=2 but MASTER_ADDR is not set",)),
    # a rank missing or outside the world
    "no RANK": (_without("RANK"), ("WORLD_SIZE=2 but RANK is not set",)),
    "RANK = WORLD_SIZE": ({**TORCHRUN, "RANK": "2"}, ("RANK=2 must be < WORLD_SIZE=2",)),
    "RANK without WORLD_SIZE": ({"RANK": "3"}, ("RANK=3 but WORLD_SIZE is not set",)),
    # local ranks inconsistent with the node's or the world's size
    "LOCAL_RANK = LOCAL_WORLD_SIZE": ({**TORCHRUN, "LOCAL_RANK": "2"}, ("LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2",)),
    "LOCAL_RANK in a world of 1": ({"LOCAL_RANK": "1"}, ("LOCAL_RANK=1 must be < WORLD_SIZE=1",)),
    "LOCAL_WORLD_SIZE > WORLD_SIZE": ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, ("LOCAL_WORLD_SIZE=4 must be <= WORLD_SIZE=2",)),
    # values that are not what they must be
    "WORLD_SIZE=two": ({**TORCHRUN, "WORLD_SIZE": "two"}, ("WORLD_SIZE must be a whole number >= 1, got 'two'",)),
    "WORLD_SIZE=0": ({"WORLD_SIZE": "0"}, ("WORLD_SIZE must be a whole number >= 1, got '0'",)),
    "WORLD_SIZE empty": ({"WORLD_SIZE": ""}, ("WORLD_SIZE must be a whole number >= 1, got ''",)),
    "RANK=-1": ({**TORCHRUN, "RANK": "-1"}, ("RANK must be a whole number >= 0, got '-1'",)),
    "RANK=1.0": ({**TORCHRUN, "RANK": "1.0"}, ("RANK must be a whole number >= 0, got '1.0'",)),
    "LOCAL_RANK=x": ({**TORCHRUN, "LOCAL_RANK": "x"}, ("LOCAL_RANK must be a whole number >= 0, got 'x'",)),
    "fullwidth digit": ({**TORCHRUN, "RANK": "１"}, ("RANK must be a whole number",)),
    "MASTER_PORT=http": ({**TORCHRUN, "MASTER_PORT": "http"}, ("MASTER_PORT must be a port number from 1 to 65535, got 'http'",)),
    "MASTER_PORT=0": ({**TORCHRUN, "MASTER_PORT": "0"}, ("MASTER_PORT must be a port number", "got '0'")),
    "MASTER_PORT=70000": ({**TORCHRUN, "MASTER_PORT": "70000"}, ("got '70000'",)),
    "MASTER_PORT in a world of 1": ({"MASTER_PORT": "x1"}, ("MASTER_PORT must be a port number",)),
    "MASTER_ADDR empty": ({**TORCHRUN, "MASTER_ADDR": ""}, ("MASTER_ADDR must be rank 0's host name or address, got ''",)),
    "MASTER_ADDR a URL": ({**TORCHRUN, "MASTER_ADDR": "tcp://node1 x"}, ("MASTER_ADDR must be rank 0's host name",)),
    "MASTER_ADDR unknown": ({**TORCHRUN, "MASTER_ADDR": "no-such-host.invalid"},
                            ("MASTER_ADDR='no-such-host.invalid' does not resolve",)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mistake_is_named(name):
    env, says = CASES[name]
    with pytest.raises(LaunchEnvError) as e:
        read_launch_env(env)
    for text in says:
        assert text in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_gpu_process_needs_its_device():
    check_device(1, 2)
    with pytest.raises(LaunchEnvError, match=r"LOCAL_RANK=2 but this node has 2 GPU\(s\)"):
        check_device(2, 2)


def test_rank_hint_reads_what_it_can():
    assert rank_hint({"RANK": "3"}) == 3 and rank_hint({"RANK": "three"}) == 0 and rank_hint({}) == 0


@pytest.mark.parametrize("name", ["no MASTER_ADDR/PORT", "no RANK", "RANK = WORLD_SIZE", "LOCAL_RANK = LOCAL_WORLD_SIZE",
                                  "WORLD_SIZE=two", "MASTER_PORT=http", "RANK=-1", "RANK=1.0"])
def test_the_entry_point_says_it_in_one_line(capsys, monkeypatch, tmp_path, name):
    """``megatron-rl demo`` as each rank of a launch made by hand runs it: one line, exit 2, before
    anything is made (also when RANK itself is no number: the line still prints)."""
    env, says = CASES[name]
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    code = main(["demo", "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    check_one_line(code, out, err, *says)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_meeting_that_fails_is_one_line(tmp_path):
    """torch's rendezvous, for real: rank 0's port taken by another program, and rank 0 waiting for a
    rank 1 that was never started. Both say where they tried to meet, in one line, exit 2."""
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    servers = [*SERVERS, "policy.parallel.timeout_s=3"]
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    base.update(PYTHONPATH=str(REPO), WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "demo"]
    cases = {"port taken": (str(taken.getsockname()[1]), ("could not meet at MASTER_ADDR=127.0.0.1",
                                                           f"MASTER_PORT={taken.getsockname()[1]}", "EADDRINUSE")),
             "rank 1 missing": (str(_free_port()), ("could not meet", "1/2 clients joined", "waited up to 3 s"))}
    procs = {name: subprocess.Popen([*cmd, "--run-dir", str(tmp_path / name.replace(" ", "_")), *servers],
                                    env={**base, "MASTER_PORT": port}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (port, _) in cases.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            check_one_line(proc.returncode, out, err, *cases[name][1])
    finally:
        taken.close()
