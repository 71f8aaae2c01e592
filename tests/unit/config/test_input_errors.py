"""Input errors in configs: every override mistake names the key and the command line; every
numeric field refuses values that cannot work; the cross-component checks name their key."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import get_args, get_origin, get_type_hints

import pytest
import yaml

from megatron_rl.config import ConfigError
from megatron_rl.config.base import COMMAND_LINE, ConfigBase, yaml_key
from megatron_rl.config.loader import load
from megatron_rl.tools.difficulty import DifficultyConfig
from megatron_rl.trainer.schema import RunConfig, load_run_config

MIN = {"model": {"tiny": {}}, "data": {"train_path": "x.jsonl"},
       "stages": [{"name": f"s{i}", "max_response_len": 8, "max_steps": 1} for i in range(3)]}


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(MIN))
    return p


def _error(path, overrides, loader=load_run_config) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        loader(path, overrides)
    return e.value


@pytest.mark.parametrize("override,key,says", [
    ("rollout.temprature=1", "rollout.temprature", "unknown key"),
    ("algo.clip.eps_high=high", "algo.clip.eps_high", "expected a number"),
    ("rollout.temperature=", "rollout.temperature", "empty value"),
    ("rollout.temperature=  ", "rollout.temperature", "empty value"),
    ("rollout.group_size=[1,", "rollout.group_size", "cannot parse"),
    ("rollout.group_size={a: ", "rollout.group_size", "cannot parse"),
    ("stages.5.max_steps=1", "stages.5.max_steps", "3 entries"),
    ("stages.x.max_steps=1", "stages.x.max_steps", "is a list"),
    ("rollout.temperature.x=1", "rollout.temperature", "expected a number"),
    ("stages.0.name.x=1", "stages.0.name.x", "not a mapping"),
    ("rollout..temperature=1", "rollout..temperature", "empty key"),
    ("=1", "=1", "empty key"),
    ("rollout.temperature", "rollout.temperature", "key.sub=value"),
    ("nonsense=1", "nonsense", "unknown key"),
    ("stages.0.max_steps=0", "stages[0].max_steps", "must be >= 1"),
    ("stages.1=3", "stages[1]", "expected a mapping"),
    ("stages=[]", "stages", "at least one stage"),
])
def test_override_errors_name_the_key_and_the_command_line(cfg_file, override, key, says):
    err = _error(cfg_file, [override])
    assert err.key == key and err.source == COMMAND_LINE, str(err)
    msg = str(err)
    assert "on the command line" in msg and says in msg, msg
    assert str(cfg_file) not in msg  # never blames the file


def test_a_mistake_in_the_file_still_names_the_file(cfg_file):
    cfg_file.write_text(yaml.safe_dump({**MIN, "rollout": {"temprature": 1}}))
    err = _error(cfg_file, ["rollout.temperature=0.5"])
    assert err.key == "rollout.temprature" and str(cfg_file) in str(err)
    assert "command line" not in str(err)


def test_difficulty_tool_overrides_name_the_command_line(tmp_path):
    err = _error(None, ["k=zero"], loader=lambda p, o: load(DifficultyConfig, p, o))
    assert err.key == "k" and "on the command line" in str(err)


@pytest.mark.parametrize("defaults", ["{a: b.yaml}", "3", "[1, 2]", "['']"])
def test_defaults_must_be_a_list_of_files(tmp_path, defaults):
    p = tmp_path / "c.yaml"
    p.write_text(f"defaults: {defaults}\n" + yaml.safe_dump(MIN))
    err = _error(p, [])
    assert err.key == "defaults" and str(p) in str(err)


def test_not_utf8_config_file_names_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"rollout: {temperature: 1.0}\n# \xff\xfe\n")
    err = _error(p, [])
    assert str(p) in str(err) and "UTF-8" in str(err)


# --- every numeric field refuses what cannot work ----------------------------------------------
# Fields where 0 is a meaningful setting ("0 disables", "0 = all", a seed, a rate or weight that
# may be zero). Everything numeric not listed must refuse 0; everything must refuse -1 except
# NEGATIVE_OK. A new field fails this test until it has a range check or is listed here with why.
ZERO_OK = {
    "model.tiny.seed", "policy.seed", "trainer.seed",
    "policy.optim.lr", "policy.optim.min_lr", "policy.optim.weight_decay", "policy.optim.adam_beta1",
    "policy.optim.adam_beta2", "policy.optim.clip_grad", "policy.optim.lr_warmup_steps",
    "rollout.kv_cache_bytes",  # 0: vLLM sizes the cache (GPU)
    "rollout.async.max_staleness", "rollout.async.oversample",  # 0: the synchronous loop
    "rollout.max_inflight_seqs",  # 0: rollout.max_num_seqs per engine
    "sync.retries",  # 0: no second sync after a failed one
    "algo.adv_eps", "algo.clip.eps_low", "algo.entropy.coef", "algo.entropy.target",
    "algo.entropy.delta", "algo.entropy.coef_min", "algo.entropy.coef_max", "algo.kl.coef",
    "algo.mismatch.icepop_low",
    "reward.worker_memory_mb",  # 0: no limit
    "data.max_prompt_len", "data.max_rows", "data.pass_rate_min", "data.pass_rate_max",
    "trainer.save_every", "trainer.max_steps_without_update",  # 0: never stop
    "sft.slow_down_at", "sft.stop_accuracy", "sft.max_seconds",
    "eval.size", "eval.every", "stages.0.plateau.patience", "stages.0.plateau.min_delta",
    "stages.0.lr", "algo.correct_reward", "algo.wrong_reward",
    # tools/difficulty
    "seed", "summary_examples", "hard_max_pass_rate", "correct_reward", "min_source_pass_rate",
    # the live wrong-label rule: window 0 = every sample; pass rates 0 = stuck at 0 / no competence
    # check; 0 examples / points = none drawn
    "data.wrong_labels.window", "data.wrong_labels.hard_max_pass_rate",
    "data.wrong_labels.suspect_max_pass_rate", "data.wrong_labels.min_source_pass_rate",
    "data.wrong_labels.hard_examples", "data.wrong_labels.points_max",
    "tracking.rollouts.max_gb", "tracking.rollouts.wandb_samples",  # 0: no cap, no W&B table
    "synthetic.sft_size", "synthetic.wrong_label_fraction", "synthetic.hard_fraction",  # 0: none
}
# Rewards may be any number (wrong < correct is checked); top_k = -1 disables top-k.
NEGATIVE_OK = {"algo.correct_reward", "algo.wrong_reward", "rollout.top_k", "top_k", "correct_reward"}


def _numeric(tp) -> bool:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return len(args) == 1 and _numeric(args[0])
    return tp in (int, float)


def _config_class(tp):
    args = [a for a in get_args(tp) if a is not type(None)] \
        if get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    if get_origin(tp) is list and get_args(tp):
        args = [get_args(tp)[0]]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], ConfigBase):
        return args[0]
    return None


def numeric_keys(cls, prefix="") -> list[str]:
    """Dotted keys of every int / float field under ``cls`` (list entries as ``.0.``)."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{yaml_key(f)}"
        sub = _config_class(tp)
        if sub is not None:
            keys += numeric_keys(sub, key + (".0." if get_origin(tp) is list else "."))
        elif _numeric(tp):
            keys.append(key)
    return keys


ROOTS = {"run": (RunConfig, lambda p, o: load_run_config(p, o)),
         "difficulty": (DifficultyConfig, lambda p, o: load(DifficultyConfig, None, o))}
CASES = [(root, key, value) for root, (cls, _) in ROOTS.items() for key in numeric_keys(cls)
         for value in (0, -1)
         if not (value == 0 and key in ZERO_OK) and not (value == -1 and key in NEGATIVE_OK)]


def test_the_walk_finds_the_fields():
    keys = numeric_keys(RunConfig)
    assert {"model.tiny.num_heads", "stages.0.max_steps", "reward.code.sandbox.memory_mb",
            "rollout.group_size", "policy.parallel.tensor_parallel"} <= set(keys)
    assert len(keys) > 80


@pytest.mark.parametrize("root,key,value", CASES)
def test_every_numeric_field_refuses_values_that_cannot_work(cfg_file, root, key, value):
    err = _error(cfg_file, [f"{key}={value}"], loader=ROOTS[root][1])
    assert err.key.replace("[", ".").replace("]", "") == key, str(err)
    assert "on the command line" in str(err)


# --- cross-component checks ----------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key,says", [
    (["rollout.group_size=1"], "rollout.group_size", "zero reward variance"),
    (["algo.adv_estimator=dr_grpo", "rollout.group_size=1"], "rollout.group_size", "dr_grpo"),
    (["sft.control=true"], "sft.control", "sft.enabled"),
    (["trainer.run_dir=''"], "trainer.run_dir", "empty"),
    (["trainer.run_dir=' '"], "trainer.run_dir", "empty"),
    (["model.tiny.num_heads=0"], "model.tiny.num_heads", ">= 1"),
    (["synthetic.min_digits=3", "synthetic.max_digits=2"], "synthetic.max_digits", "min_digits"),
])
def test_values_that_cannot_work_together_are_refused(cfg_file, overrides, key, says):
    err = _error(cfg_file, overrides)
    assert err.key == key and says in str(err), str(err)


def test_stage_longer_than_the_tiny_models_positions_names_stage_and_numbers(cfg_file):
    err = _error(cfg_file, ["model.tiny.max_position_embeddings=100", "rollout.max_prompt_len=64",
                            "stages.2.max_response_len=40"])
    assert err.key == "stages[2].max_response_len"
    msg = str(err)
    assert "'s2'" in msg and "64" in msg and "40" in msg and "104" in msg and "100" in msg, msg


def test_stage_longer_than_a_real_models_positions(cfg_file):
    from megatron_rl.trainer.schema import check_model_limits

    cfg = load_run_config(cfg_file, ["rollout.max_prompt_len=64", "stages.1.max_response_len=65"])
    check_model_limits(cfg, 129, "m/config.json")  # fits
    with pytest.raises(ConfigError) as e:
        check_model_limits(cfg, 128, "m/config.json")
    assert e.value.key == "stages[1].max_response_len" and "'s1'" in str(e.value)
    assert "m/config.json" in str(e.value) and "128" in str(e.value)
