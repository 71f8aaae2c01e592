"""The config loader: unknown keys and bad values fail naming the key (and file); every shipped
config file loads and validates (as NeMo-RL's CI does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.trainer.schema import load_run_config as load_config

REPO = Path(__file__).resolve().parents[3]
MIN = """
model: {tiny: {}}
data: {train_path: x.jsonl}
stages: [{name: s1, max_response_len: 8, max_steps: 1}]
"""


def _write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")))
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(REPO / path)
    assert cfg.stages


def test_unknown_key_is_an_error_naming_key_and_file(tmp_path):
    p = _write(tmp_path, MIN + "algo: {clip: {eps_hihg: 0.3}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.key == "algo.clip.eps_hihg"
    assert str(p) in str(e.value) and "eps_high" in str(e.value)  # lists the valid keys


@pytest.mark.parametrize("override,key", [
    ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.group_size=abc", "rollout.group_size"),
    ("algo.clip.eps_high=0.1", "algo.clip.eps_high"),
    ("algo.loss_agg=token-sum", "algo.loss_agg"),
    ("stages.0.max_response_len=0", "stages[0].max_response_len"),
    ("algo.mini_batches=3", "algo.mini_batches"),
])
def test_bad_value_names_the_key(tmp_path, override, key):
    p = _write(tmp_path, MIN)
    with pytest.raises(ConfigError) as e:
        load_config(p, [override])
    assert e.value.key == key, str(e.value)


def test_defaults_inheritance_overrides_and_run_dir_substitution(tmp_path):
    _write(tmp_path, MIN + "rollout: {temperature: 0.9, group_size: 4}\n", "base.yaml")
    p = _write(tmp_path, "defaults: [base.yaml]\nrollout: {group_size: 16}\neval: {path: '{run_dir}/e.jsonl'}\n")
    cfg = load_config(p, ["trainer.run_dir=/r", "rollout.top_p=0.5"])
    assert (cfg.rollout.temperature, cfg.rollout.group_size, cfg.rollout.top_p) == (0.9, 16, 0.5)
    assert cfg.eval.path == "/r/e.jsonl"


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    from megatron_rl.cli import main

    p = _write(tmp_path, MIN + "rollout: {temperatur: 1.0}\n")
    assert main(["validate", str(p)]) == 2
    assert "rollout.temperatur" in capsys.readouterr().err


def test_docs_config_reference_is_current():
    import contextlib
    import io

    from megatron_rl.tools import config_reference

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        config_reference.main()
    assert (REPO / "docs" / "config.md").read_text() == buf.getvalue(), \
        f"docs/config.md is stale: run `{config_reference.COMMAND} > docs/config.md`"


def test_duplicate_yaml_key_is_an_error(tmp_path):
    p = _write(tmp_path, MIN + "policy: {seed: 1}\npolicy: {seed: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "duplicate key 'policy'" in str(e.value) and str(p) in str(e.value)
