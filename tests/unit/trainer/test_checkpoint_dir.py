"""The run directory's checkpoint protocol on plain files: what counts as complete, damage found
before anything is loaded (naming the file), the fall-back to the previous checkpoint, a damaged
run_state.json, and what start-up recovery does with a save that a kill interrupted. The same
protocol under real kill -9 with the real policy: tests/integration/trainer/test_checkpoint_atomic.py."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.trainer.checkpointing import resume_point
from megatron_rl.trainer.state import (STATE_FILE, CheckpointError, RunDir, TrainerState,
                                      checkpoint_damage, commit, staging_dir, write_manifest)


def fake_checkpoint(ckpt, step: int, shard: bytes = b"x" * 1000):
    """What write_checkpoint leaves: files, then the manifest, then the trainer state."""
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "policy" / "__0_0.distcp").write_bytes(shard)
    (ckpt / "policy" / "metadata.json").write_text("{}")
    write_manifest(ckpt)
    RunDir.write_state(ckpt, TrainerState(stage="s", step=step))
    return ckpt


@pytest.fixture
def run(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in (1, 2, 3):
        fake_checkpoint(run.step_dir("s", step), step)
    return run


def test_intact_checkpoints_and_the_newest_first(run):
    assert [p.name for p in run.step_checkpoints("s")] == ["step_000003", "step_000002", "step_000001"]
    assert all(checkpoint_damage(p) is None for p in run.step_checkpoints("s"))


@pytest.mark.parametrize("damage,says", [
    ("truncate", "999 bytes, 1000 when it was written"),
    ("delete", "missing"),
    ("state_json", STATE_FILE),
    ("state_fields", STATE_FILE),
    ("manifest", "manifest.json"),
])
def test_damage_is_found_naming_the_file(run, damage, says):
    ckpt = run.step_dir("s", 3)
    shard = ckpt / "policy" / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(b"x" * 999)
    elif damage == "delete":
        shard.unlink()
    elif damage == "state_json":
        (ckpt / STATE_FILE).write_text('{"step": 3,')
    elif damage == "state_fields":
        (ckpt / STATE_FILE).write_text('{"no_such_field": 1}')
    else:
        (ckpt / "manifest.json").write_bytes(b"\xff\xfe")
    problem = checkpoint_damage(ckpt)
    assert problem is not None and says in problem and str(ckpt) in problem, problem


def test_resume_falls_back_to_the_previous_checkpoint_and_says_so(run, caplog):
    (run.step_dir("s", 3) / "policy" / "__0_0.distcp").write_bytes(b"short")
    (run.step_dir("s", 2) / STATE_FILE).write_text("not json")
    ctx = SimpleNamespace(run=run)
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert resume_point(ctx, "s") == run.step_dir("s", 1)
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert "step_000003" in warned and "__0_0.distcp" in warned and "falling back" in warned
    assert "step_000002" in warned and STATE_FILE in warned
    # every checkpoint damaged: nothing to resume from (the stage starts over, after the warnings)
    (run.step_dir("s", 1) / "policy" / "metadata.json").unlink()
    assert resume_point(ctx, "s") is None


def test_checkpoints_from_before_manifests_are_taken_as_they_are(run):
    ckpt = run.step_dir("s", 3)
    (ckpt / "manifest.json").unlink()
    assert checkpoint_damage(ckpt) is None


@pytest.mark.parametrize("content", ['{"finished_stages": ["s1"', "[1, 2]", '{"finished_stages": 3}',
                                     b"\xff\xfe"])
def test_damaged_run_state_names_the_file(tmp_path, content):
    run = RunDir(tmp_path)
    p = tmp_path / "run_state.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError) as e:
        run.read_run_state()
    assert str(p) in str(e.value) and "damaged" in str(e.value)


def test_run_state_round_trip_and_defaults(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.read_run_state() == {"finished_stages": [], "sft_done": False}
    run.write_run_state({"finished_stages": ["a"], "wandb_run_id": "x"})
    assert run.read_run_state() == {"finished_stages": ["a"], "wandb_run_id": "x", "sft_done": False}
    assert not list((tmp_path / "r").glob("*.tmp"))


def test_commit_replaces_and_recover_finishes_or_clears(run):
    final = run.final_dir("s")
    fake_checkpoint(final, 10)
    # a save that got as far as its trainer state, killed before its commit: finished by recover
    fake_checkpoint(staging_dir(final), 11)
    # a save killed while writing: no trainer state yet, cleared by recover
    half = staging_dir(run.step_dir("s", 4))
    (half / "policy").mkdir(parents=True)
    (half / "policy" / "__0_0.distcp").write_bytes(b"x")
    # a deletion killed after its rename: cleared
    trash = run.step_dir("s", 1).parent / ".step_000001.trash-1-2"
    run.step_dir("s", 1).rename(trash)
    run.recover()
    assert RunDir.read_state(final).step == 11 and checkpoint_damage(final) is None
    assert not staging_dir(final).exists() and not half.exists() and not trash.exists()
    assert [p.name for p in run.step_checkpoints("s")] == ["step_000003", "step_000002"]
    # a plain commit over an existing checkpoint
    fake_checkpoint(staging_dir(final), 12)
    commit(staging_dir(final), final)
    assert RunDir.read_state(final).step == 12 and not list(final.parent.glob(".*"))


def test_prune_keeps_the_newest(run):
    run.prune("s", 2)
    assert [p.name for p in run.step_checkpoints("s")] == ["step_000003", "step_000002"]
    assert not list(run.step_dir("s", 1).parent.glob(".*"))


def test_read_state_of_a_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        RunDir.read_state(tmp_path)


def test_a_written_checkpoint_lists_every_file_and_any_changed_byte_is_found(tmp_path):
    """write_checkpoint (the trainer's save, with a stand-in policy) with what a step and a stage end
    add: the rollouts generated ahead, the HF export, the wrong-label monitor's state. The manifest
    lists every file the checkpoint holds (all but itself and the trainer state, which is parsed);
    one byte changed in any of them (same size) or a truncation is found, naming the file."""
    import json

    import torch

    from megatron_rl.trainer.rollout_state import STATE_FILE as ROLLOUTS_FILE
    from megatron_rl.trainer.checkpointing import MONITOR_FILE, write_checkpoint

    def save_policy(path):
        Path(path).mkdir(parents=True)
        for name, size in (("__0_0.distcp", 3000), ("__1_0.distcp", 2000), (".metadata", 100)):
            (Path(path) / name).write_bytes(bytes(range(256)) * (size // 256) + b"z" * (size % 256))

    def also(staging):  # what save_checkpoint / finish_stage pass: rollouts, the HF export
        torch.save({"groups": [{"completions": [[1, 2, 3]]}]}, staging / ROLLOUTS_FILE)
        (staging / "hf").mkdir()
        (staging / "hf" / "model.safetensors").write_bytes(b"\x01" * 4096)
        (staging / "hf" / "config.json").write_text('{"model_type": "llama"}')

    ctx = SimpleNamespace(is_driver=True, groups=SimpleNamespace(barrier=lambda: None),
                          policy=SimpleNamespace(save_checkpoint=save_policy),
                          entropy_ctl=SimpleNamespace(state_dict=lambda: {"alpha": 0.1}),
                          observer=SimpleNamespace(monitor=SimpleNamespace(state_dict=lambda: {"counts": [1, 2]})))
    ckpt = tmp_path / "run" / "s" / "checkpoints" / "step_000004"
    write_checkpoint(ctx, ckpt, TrainerState(stage="s", step=4), None, also=also)
    held = sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file())
    listed = sorted(json.loads((ckpt / "manifest.json").read_text()))
    assert listed == sorted(set(held) - {"manifest.json", STATE_FILE})
    assert {ROLLOUTS_FILE, "hf/model.safetensors", "hf/config.json", MONITOR_FILE,
            "policy/.metadata"} <= set(listed)
    assert checkpoint_damage(ckpt) is None
    for rel in listed:
        f = ckpt / rel
        original = f.read_bytes()
        for damaged in (original[:-1], original[:len(original) // 2] + bytes([original[len(original) // 2] ^ 1])
                        + original[len(original) // 2 + 1:]):
            f.write_bytes(damaged)
            problem = checkpoint_damage(ckpt)
            assert problem is not None and str(f) in problem, (rel, problem)
        f.write_bytes(original)
        assert checkpoint_damage(ckpt) is None


def test_start_up_checks_the_checkpoint_and_models_later_stages_read(tmp_path, tiny_llama):
    """trainer.init_from, the KL reference and the distillation teacher are read when a stage
    begins (after the SFT cold start): a wrong path is refused at start-up instead, naming the key;
    init_from only while the first stage has not started (a resumed run no longer reads it)."""
    from megatron_rl.models.hf_config import HFModelError
    from megatron_rl.trainer.context import check_model_dirs
    from megatron_rl.trainer.schema import load_run_config

    demo = str(Path(__file__).resolve().parents[3] / "configs" / "demo_cpu.yaml")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")

    def check(*overrides):
        cfg = load_run_config(demo, [f"trainer.run_dir={tmp_path / 'run'}", *overrides])
        check_model_dirs(cfg, RunDir(cfg.trainer.run_dir))
        return cfg

    check(f"trainer.init_from={fake_checkpoint(tmp_path / 'good', 5)}")
    with pytest.raises(CheckpointError, match=r"trainer.init_from=.*empty is not a complete checkpoint"):
        check(f"trainer.init_from={tmp_path / 'empty'}")
    cfg = load_run_config(demo, [f"trainer.run_dir={tmp_path / 'run'}"])
    fake_checkpoint(RunDir(tmp_path / "run").step_dir(cfg.stages[0].name, 3), 3)
    check(f"trainer.init_from={tmp_path / 'empty'}")  # the first stage has started: not read again
    check("algo.kl.enabled=true", f"policy.reference.path={tiny_llama}",
          "algo.distill.coef=1", f"algo.distill.teacher={tiny_llama}")
    for overrides, key in (
            (["algo.kl.enabled=true", f"policy.reference.path={tmp_path / 'empty'}"], "policy.reference.path"),
            (["algo.distill.coef=1", f"algo.distill.teacher={tmp_path / 'bad'}"], "algo.distill.teacher")):
        with pytest.raises(HFModelError, match=rf"^{key}: .*(does not exist|not valid JSON)"):
            check(*overrides)
