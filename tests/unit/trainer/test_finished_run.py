"""A run whose directory already holds everything the run would make returns at once: nothing is
built (no process group, engine or policy), for the whole run and for one finished stage."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_rl.cli import main
from megatron_rl.trainer.run import nothing_left
from megatron_rl.trainer.schema import load_run_config

MIN = {"model": {"tiny": {}}, "data": {"train_path": "x.jsonl"},
       "stages": [{"name": f"s{i}", "max_response_len": 8, "max_steps": 1} for i in range(2)]}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**MIN, "trainer": {"run_dir": str(d)}}))
    return d


def _state(run_dir, finished, summary=True, **extra):
    (run_dir / "run_state.json").write_text(json.dumps({"finished_stages": finished, **extra}))
    (run_dir / "summary.json").unlink(missing_ok=True)
    if summary:
        (run_dir / "summary.json").write_text("{}")


def _cfg(run_dir, *overrides):
    return load_run_config(run_dir.parent / "c.yaml", list(overrides))


def test_only_a_finished_run_with_its_summary_has_nothing_left(run_dir):
    assert not nothing_left(_cfg(run_dir))  # a fresh directory
    _state(run_dir, ["s0"])
    assert not nothing_left(_cfg(run_dir)) and nothing_left(_cfg(run_dir), "s0")
    assert not nothing_left(_cfg(run_dir), "s1")
    _state(run_dir, ["s0", "s1"], summary=False)  # stopped before the summary was written
    assert not nothing_left(_cfg(run_dir))
    _state(run_dir, ["s0", "s1"])
    assert nothing_left(_cfg(run_dir))
    control = ("sft.enabled=true", "sft.control=true")
    assert not nothing_left(_cfg(run_dir, *control))  # the control experiment is still to run
    _state(run_dir, ["s0", "s1"], control={"control/accuracy": 0.5})
    assert nothing_left(_cfg(run_dir, *control))


def test_train_on_a_finished_run_returns_before_building_anything(run_dir, monkeypatch, caplog):
    import megatron_rl.models as models

    def refuse(*a, **k):
        raise AssertionError("init_distributed called for a finished run")

    monkeypatch.setattr(models, "init_distributed", refuse)
    _state(run_dir, ["s0", "s1"])
    with caplog.at_level("INFO", logger="megatron_rl"):
        assert main(["train", "--config", str(run_dir.parent / "c.yaml")]) == 0
        assert main(["train", "--config", str(run_dir.parent / "c.yaml"), "--stage", "s1"]) == 0
    assert "every stage already finished; nothing to do" in caplog.text
    assert "stage s1 already finished; nothing to do" in caplog.text
    _state(run_dir, ["s0"])
    with pytest.raises(AssertionError, match="init_distributed called"):
        main(["train", "--config", str(run_dir.parent / "c.yaml")])
