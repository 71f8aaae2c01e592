"""Input errors in configs: every override mistake names the key and the command line; every
numeric field declares the range it accepts and refuses the values outside it; the cross-component
checks name their key."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import get_args, get_origin, get_type_hints

import pytest
import yaml

from launch.config import LaunchConfig
from megatron_rl.config import ConfigError
from megatron_rl.config.base import COMMAND_LINE, ConfigBase, Range, field_range, yaml_key
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
# Each numeric field declares the values it accepts where it is declared (``ranged(8, ge=1)``, a
# ``Range``): validation checks that declaration, and this test reads it. A new numeric field fails
# here until it declares its range (``ranged(x)`` with no bound says "any number").
def _numeric(tp) -> bool:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return len(args) == 1 and _numeric(args[0])
    return tp in (int, float)


def _is_int(tp) -> bool:
    return tp is int or int in get_args(tp)


def _config_class(tp):
    args = [a for a in get_args(tp) if a is not type(None)] \
        if get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    if get_origin(tp) is list and get_args(tp):
        args = [get_args(tp)[0]]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], ConfigBase):
        return args[0]
    return None


def numeric_fields(cls, prefix="") -> dict[str, tuple[Range | None, bool]]:
    """Dotted key (list entries as ``.0.``) -> (declared range, is an int) of every int / float
    field under ``cls``."""
    out = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{yaml_key(f)}"
        sub = _config_class(tp)
        if sub is not None:
            out.update(numeric_fields(sub, key + (".0." if get_origin(tp) is list else ".")))
        elif _numeric(tp):
            out[key] = (field_range(f), _is_int(tp))
    return out


def outside(bounds: Range, is_int: bool) -> list:
    """Values just outside the declared range, and 0 and -1 where the range leaves them out."""
    step = 1 if is_int else 0.5
    probes = {0, -1}
    if bounds.ge is not None:
        probes.add(bounds.ge - step)
    if bounds.gt is not None:
        probes.add(bounds.gt)
    if bounds.le is not None:
        probes.add(bounds.le + step)
    if bounds.lt is not None:
        probes.add(bounds.lt)
    return sorted(v for v in probes if v not in bounds and (not is_int or float(v).is_integer()))


def inside_edges(bounds: Range) -> list:
    """The declared range's closed ends and its single extra values."""
    return [v for v in (bounds.ge, bounds.le, *bounds.also) if v is not None]


ROOTS = {"run": (RunConfig, lambda p, o: load_run_config(p, o)),
         "difficulty": (DifficultyConfig, lambda p, o: load(DifficultyConfig, None, o)),
         "launch": (LaunchConfig, lambda p, o: load(LaunchConfig, None, ["stage=1", *o]))}
FIELDS = {(root, key): spec for root, (cls, _) in ROOTS.items()
          for key, spec in numeric_fields(cls).items()}
CASES = [(root, key, value) for (root, key), (bounds, is_int) in FIELDS.items() if bounds is not None
         for value in outside(bounds, is_int)]
EDGES = [(root, key, value) for (root, key), (bounds, _) in FIELDS.items() if bounds is not None
         for value in inside_edges(bounds)]


def test_every_numeric_field_declares_its_range():
    keys = {key for _, key in FIELDS}
    assert {"model.tiny.num_heads", "stages.0.max_steps", "reward.code.sandbox.memory_mb",
            "rollout.group_size", "policy.parallel.tensor_parallel"} <= keys
    assert len(keys) > 80
    undeclared = sorted(f"{root}: {key}" for (root, key), (bounds, _) in FIELDS.items() if bounds is None)
    assert not undeclared, f"declare the accepted range with ranged(...): {undeclared}"
    assert len(CASES) > 2 * len(keys) - 20  # most fields refuse at least two probes


@pytest.mark.parametrize("root,key,value", CASES)
def test_every_numeric_field_refuses_values_outside_its_range(cfg_file, root, key, value):
    err = _error(cfg_file, [f"{key}={value}"], loader=ROOTS[root][1])
    assert err.key.replace("[", ".").replace("]", "") == key, str(err)
    assert "on the command line" in str(err)
    bounds, is_int = FIELDS[root, key]
    assert err.message == bounds.refusal(int(value) if is_int else float(value)), str(err)


# A refusal by a bound of the field's own (``must be >= 2, got 1``), not one naming another field
# (``must be >= eps_low (0.2), got 0.0``).
PLAIN_RANGE = re.compile(r"must be (in [\[(][^,]+, [^\])]+[\])]|[<>]=? -?[\d.e+]+|-?\d+ or .+), got ")


@pytest.mark.parametrize("root,key,value", EDGES)
def test_the_ends_of_a_declared_range_pass_its_check(cfg_file, root, key, value):
    """Validation refuses nothing inside the declaration: no stricter check of the field's own range
    hides in a ``validate`` (another field's check may still refuse the value)."""
    try:
        ROOTS[root][1](cfg_file, [f"{key}={value}"])
    except ConfigError as err:
        own = err.key.replace("[", ".").replace("]", "") == key
        assert not (own and PLAIN_RANGE.match(err.message)), str(err)


def test_range_declarations():
    assert 0 not in Range(gt=0) and 1e-9 in Range(gt=0) and 0 in Range(ge=0) and -1e-9 not in Range(ge=0)
    assert 1 in Range(ge=0, le=1) and 1.5 not in Range(ge=0, le=1) and 1 not in Range(lt=1)
    assert -1 in Range(ge=1, also=(-1,)) and 0 not in Range(ge=1, also=(-1,)) and -5 in Range()
    assert [str(r) for r in (Range(ge=1), Range(gt=0.0), Range(gt=0.0, le=1.0), Range(ge=1, also=(-1,)),
                             Range(), Range(lt=0.5))] == [">= 1", "> 0", "(0, 1]", "-1 or >= 1", "any", "< 0.5"]
    assert Range(ge=0.0, le=1.0).refusal(2.0) == "must be in [0, 1], got 2.0"
    with pytest.raises(TypeError):
        Range(ge=0, gt=0)


# --- cross-component checks ----------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key,says", [
    (["rollout.group_size=1"], "rollout.group_size", "zero reward variance"),
    (["algo.adv_estimator=dr_grpo", "rollout.group_size=1"], "rollout.group_size", "dr_grpo"),
    (["sft.control=true"], "sft.control", "sft.enabled"),
    (["trainer.run_dir=''"], "trainer.run_dir", "empty"),
    (["trainer.run_dir=' '"], "trainer.run_dir", "empty"),
    (["model.tiny.num_heads=0"], "model.tiny.num_heads", ">= 1"),
    # in their own ranges, refused beside another field's value
    (["rollout.num_engines=0"], "rollout.num_engines", "need engine='vllm_server'"),
    (["algo.clip.eps_high=0"], "algo.clip.eps_high", "must be >= eps_low"),
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


# --- keys that only act with another setting are refused without it ------------------------------
NON_DEFAULT = {"rollout.placement": "dedicated", "rollout.engines_per_node": "2",
               "rollout.server_urls": "[http://h:8000]", "rollout.hosts": "[h1]", "rollout.registry_dir": "/tmp/r",
               "rollout.start_timeout_s": "5.0", "rollout.control_timeout_s": "5.0",
               "rollout.max_inflight_seqs": "4", "rollout.hedge_after": "2.0",
               "sync.bucket_bytes": "2048", "sync.timeout_s": "5.0", "sync.master_addr": "10.0.0.1",
               "sync.retries": "3"}
SERVERS = ["rollout.engine=vllm_server", "sync.transport=gloo"]


def test_the_walk_of_server_only_keys_is_complete():
    from megatron_rl.rollout.config import SERVER_ONLY
    from megatron_rl.sync.config import TRANSFER_ONLY

    assert sorted(NON_DEFAULT) == sorted([f"rollout.{k}" for k in SERVER_ONLY] + [f"sync.{k}" for k in TRANSFER_ONLY])


@pytest.mark.parametrize("key", sorted(NON_DEFAULT))
def test_a_server_key_with_the_in_process_engine_is_refused(cfg_file, key):
    """The in-process engine (and its in-process weight hand-over) has no fleet, buckets, store or
    retries: such a key would be accepted and do nothing. With servers it is taken."""
    value = NON_DEFAULT[key]
    extra = ["rollout.num_engines=1", "rollout.placement=external"] if key == "rollout.server_urls" else []
    load_run_config(cfg_file, [*SERVERS, *extra, f"{key}={value}"])
    err = _error(cfg_file, [f"{key}={value}"])
    assert err.key == key and "ignores it" in str(err) and ("engine='vllm'" in str(err) or "inprocess" in str(err))


def test_dynamic_sampling_with_distill_is_refused(cfg_file):
    """Distillation trains every group (all-wrong ones carry the teacher's signal): dynamic sampling
    would have no group to skip."""
    distill = ["algo.distill.coef=1.0", "algo.distill.teacher=t"]
    load_run_config(cfg_file, ["rollout.async.dynamic_sampling=true"])
    err = _error(cfg_file, ["rollout.async.dynamic_sampling=true", *distill])
    assert err.key == "rollout.async.dynamic_sampling" and "algo.distill" in str(err)


def test_max_draw_factor_needs_dynamic_sampling(cfg_file):
    load_run_config(cfg_file, ["rollout.async.dynamic_sampling=true", "rollout.async.max_draw_factor=2.0"])
    load_run_config(cfg_file, ["rollout.async.max_draw_factor=3.0"])  # the default, stated
    err = _error(cfg_file, ["rollout.async.max_draw_factor=2.0"])
    assert err.key == "rollout.async.max_draw_factor" and "dynamic_sampling=true" in str(err)
