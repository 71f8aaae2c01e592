"""Checking a config imports no torch, megatron, vllm or transformers (a job script's check,
``megatron-rl validate``, ``launch.run``: 0.3 s, not 2-10 s), and the registries still work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.common import Registry

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "megatron", "vllm", "transformers", "pyarrow", "wandb")

CHECK = """
import json, sys
from megatron_rl.tools.job_config import check_job_config
from megatron_rl.trainer.schema import load_run_config
from megatron_rl.algo.registry import ADV_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPERS, TOKEN_MASKS
from megatron_rl.algo.config import AlgoConfig
for path in sys.argv[1:]:
    load_run_config(path)
check_job_config(sys.argv[1], ["algo.adv_estimator=dr_grpo", "algo.policy_loss=reinforce"], index=1)
try:
    AlgoConfig(adv_estimator="loo").validate()
    refused = ""
except Exception as exc:
    refused = str(exc)
heavy = sorted(m for m in %r if m in sys.modules)
print(json.dumps({"heavy": heavy, "names": sorted(ADV_ESTIMATORS), "losses": sorted(POLICY_LOSSES),
                  "shapers": sorted(REWARD_SHAPERS), "masks": sorted(TOKEN_MASKS), "refused": refused}))
""" % (HEAVY,)


def test_loading_and_validating_configs_imports_no_torch():
    configs = [str(ROOT / "configs/demo_cpu.yaml"), str(ROOT / "configs/skywork_or1/recipe.yaml"),
               *map(str, sorted((ROOT / "configs/skywork_or1").glob("*/*.yaml")))]
    out = subprocess.run([sys.executable, "-c", CHECK, *configs], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["heavy"] == [], f"config checks imported {got['heavy']}"
    # the built-in variants are known (and checked) without importing their modules
    assert got["names"] == ["dr_grpo", "grpo", "grpo_passk", "passk", "reinforce_plus_plus",
                            "reinforce_plus_plus_baseline", "rloo"]
    assert got["losses"] == ["cispo", "decoupled_ppo", "gspo", "ppo_clip", "reinforce"]
    assert got["shapers"] == ["length_penalty", "overlong", "passk"]
    assert got["masks"] == ["high_entropy", "low_entropy"]
    assert "unknown advantage estimator 'loo'; valid names are ['dr_grpo', 'grpo'" in got["refused"]


def test_a_declared_name_imports_its_module_at_first_lookup():
    out = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom megatron_rl.algo import ADV_ESTIMATORS, POLICY_LOSSES\n"
        "assert 'megatron_rl.algo.advantages' not in sys.modules\n"
        "fn = ADV_ESTIMATORS['grpo']\n"
        "assert fn.__module__ == 'megatron_rl.algo.advantages' and 'torch' in sys.modules\n"
        "assert POLICY_LOSSES['reinforce'].__name__ == 'reinforce_loss'\n")],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_built_in_variant_is_declared_and_registered():
    from megatron_rl.algo import advantages, policy_loss, shaping, token_mask  # noqa: F401  (they register)
    from megatron_rl.algo.registry import ADV_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPERS, TOKEN_MASKS

    for reg in (ADV_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPERS, TOKEN_MASKS):
        built_in = {n for n, fn in reg._entries.items() if fn.__module__.startswith("megatron_rl.")}
        assert built_in == set(reg._declared), reg
        assert all(reg._entries[n].__module__ == m for n, m in reg._declared.items())


def test_registry_declared_names():
    reg = Registry("thing", declared={"a": "json", "b": "tests.unit.config.no_such_module"})
    assert "a" in reg and sorted(reg) == ["a", "b"] and len(reg) == 2
    with pytest.raises(LookupError, match="'a': json is declared to register it, and did not"):
        reg["a"]  # json imports fine but registers nothing
    with pytest.raises(ValueError, match=r"'a' is already registered \(by json\)"):
        reg.register("a")(len)  # another module than the declared one
    with pytest.raises(KeyError, match=r"valid names are \['a', 'b'\]"):
        reg["c"]
