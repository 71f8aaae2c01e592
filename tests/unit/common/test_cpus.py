"""trainer.cpu_cores: the trainer's process on its cores, the reward workers and the servers'
computing threads (vLLM's OpenMP binding) on the others, the servers' other processes and the fleet
client's thread on all of them. Checked in a child process (pinning this one would pin the test
session), with the real reward pool, fleet and launcher code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent("""
    import json, os, threading
    from pathlib import Path
    hold = threading.Event()
    early = threading.Thread(target=hold.wait, daemon=True)
    early.start()  # a thread started before the placement
    from megatron_rl.common.cpus import helper_cpus, place_trainer
    from megatron_rl.rewards.pool import HardTimeoutPool
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.fleet import EngineFleet
    from megatron_rl.rollout.launcher import ServerSpec

    def allowed(tid):
        for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                return line.split()[1]

    out = {"helpers": place_trainer([0])}
    out["main"] = sorted(os.sched_getaffinity(0))
    out["early"] = allowed(early.native_id)
    out["env_helpers"] = helper_cpus()
    out["omp_in_process"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    pool = HardTimeoutPool(1)
    try:
        res = pool.run([(os.sched_getaffinity, (0,), 30.0)])[0]
        out["reward_worker"] = sorted(res.value)
    finally:
        pool.close()
    class Engine:
        name = "e0"
        weight_version = 0
        def close(self):
            pass
    fleet = EngineFleet([Engine()], RolloutConfig())
    out["fleet_thread"] = allowed(fleet._thread.native_id)
    fleet.close()
    spec = ServerSpec(name="s", model="m", host="127.0.0.1", rollout=RolloutConfig(), max_model_len=8)
    env = spec.environment()
    out["server"] = [env.get("MRL_PIN_CPUS"), env.get("VLLM_CPU_OMP_THREADS_BIND")]
    print(json.dumps(out))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cpu_cores_pin_the_trainer_and_send_its_helpers_elsewhere():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MRL_HELPER_CPUS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rest = sorted(os.sched_getaffinity(0) - {0})
    others = ",".join(map(str, rest))
    assert out["helpers"] == out["env_helpers"] == rest
    assert out["main"] == [0] and out["early"] == "0"  # every thread, also one started before
    assert out["omp_in_process"] == "0"  # an in-process engine computes on the trainer's cores
    assert out["reward_worker"] == rest
    every = sorted(os.sched_getaffinity(0))
    assert out["fleet_thread"] in (",".join(map(str, every)), f"{every[0]}-{every[-1]}")
    assert out["server"] == [",".join(map(str, every)), others]


def test_the_servers_pin_themselves_from_the_environment():
    code = ("import os; from megatron_rl.common.cpus import pin_from_environment; pin_from_environment(); "
            "print(sorted(os.sched_getaffinity(0)))")
    one = sorted(os.sched_getaffinity(0))[-1]
    env = dict(os.environ, PYTHONPATH=str(REPO), MRL_PIN_CPUS=str(one))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [one]


def test_cpu_cores_errors_name_the_key(tmp_path):
    from megatron_rl.config.base import ConfigError
    from megatron_rl.trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match="cpu_cores.*distinct"):
        TrainerConfig(cpu_cores=[0, 0]).validate()
    from megatron_rl.common.cpus import place_trainer

    with pytest.raises(ValueError, match=r"core\(s\) \[4096\] are not among"):
        place_trainer([4096])
