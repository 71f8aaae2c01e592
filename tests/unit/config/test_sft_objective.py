"""The SFT cold start runs whatever the GRPO objective needs from a rollout: with a mismatch
correction, the KL loss, decoupled PPO, distillation and a token mask configured, SFT (whose
demonstrations have no engine log-probs, reference, teacher or old-policy entropy) trains with the
plain policy gradient at ratio 1 (the NLL's gradient) and the run goes on to its GRPO stages, where
those terms act. (Before: an SFT run with algo.mismatch.mode=tis_token or algo.kl.enabled died in
its first step.)"""

import dataclasses

import pytest

from test_every_key_acts import _config, base_overrides, run_fake


@pytest.mark.parametrize("extra", [
    ["algo.mismatch.mode=tis_token", "algo.kl.enabled=true", "algo.clip.dual_clip_c=3.0"],
    ["algo.policy_loss=decoupled_ppo", "algo.distill.coef=1.0", "algo.distill.teacher=teacher",
     "algo.token_mask.mode=high_entropy"],
], ids=["tis_kl", "decoupled_ppo_distill_token_mask"])
def test_sft_cold_start_with_rollout_terms_configured(extra, tmp_path):
    cfg = _config(base_overrides(tmp_path) + ["sft.enabled=true", *extra], tmp_path, {})
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=str(tmp_path / "run")))
    out = run_fake(cfg, tmp_path)
    assert out["code"] == 0, out["code"]
    sft = [r for r in out["rows"] if r["stage"] == "sft"]
    grpo = [r for r in out["rows"] if r["stage"] != "sft"]
    assert sft and grpo
    assert all("actor/tis_weight_mean" not in r and "distill/reverse_kl" not in r for r in sft)
    key = "actor/tis_weight_mean" if "algo.mismatch.mode=tis_token" in extra else "distill/reverse_kl"
    assert all(key in r for r in grpo if r.get("batch/sequences"))
