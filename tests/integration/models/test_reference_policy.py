"""The KL reference policy and the trainer's log-prob phase, single rank (in this process, gloo),
against float64 Hugging Face transformers.

Checks: the reference holds the starting weights (from an HF checkpoint or from the model part of a
policy checkpoint), stays frozen while the policy trains, and building it consumes no random
numbers; the log-prob phase (``grpo.add_logprobs``) fills old and reference log-probs equal to the
float64 ones, shapes the rewards with the KL penalty (``algo.kl.as_reward``) and recomputes the
advantages from them; the KL loss term of the update sees the reference's log-probs. Tolerances:
log-probs 2e-5 absolute (fp32 Megatron vs float64), derived values 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch

from policy_testlib import (LENGTHS, PROMPTS, hf_reference, make_batch, make_loss_fn, max_abs_diff,
                            write_hf_model)

pytestmark = pytest.mark.slow

T = 0.7


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A: the policy's start (tied embeddings); B: A with every weight nudged (a nearby reference)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("ref")
    a = write_hf_model(root / "a", "qwen2", tie=True, kv_heads=1)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "b")
    return {"a": a, "b": root / "b", "root": root}


def _cfg(**reference):
    from megatron_rl.models import OptimConfig, PolicyConfig
    from megatron_rl.models.config import ReferenceConfig

    return PolicyConfig(micro_batch_tokens=40, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                        reference=ReferenceConfig(**reference))


def _rl_batch():
    """Two groups of three; group 1 is all-correct, so only the KL penalty can separate it."""
    batch = make_batch(LENGTHS, PROMPTS)
    batch.token_fields["rollout_logp"] = [torch.zeros(n) for n in batch.response_lens]
    batch.seq_fields.update(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
                            group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
                            truncated=torch.zeros(6, dtype=torch.bool),
                            advantages=torch.zeros(6))
    return batch


def test_reference_is_the_frozen_starting_weights(dirs, groups):
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy

    cfg = _cfg()
    policy = MegatronPolicy.from_hf(str(dirs["a"]), cfg, groups)
    ckpt = dirs["root"] / "start_ckpt"
    policy.save_checkpoint(ckpt)  # what the SFT cold start / a stage's final leaves
    rng = torch.get_rng_state()
    from_ckpt = ReferencePolicy.from_checkpoint(ckpt, policy.arch, cfg, groups)
    from_hf = ReferencePolicy.from_hf(str(dirs["a"]), cfg, groups)
    assert torch.equal(rng, torch.get_rng_state()), "building the reference drew random numbers"
    assert not any(p.requires_grad for chunk in from_hf.model for p in chunk.parameters())

    batch = make_batch(LENGTHS, PROMPTS, seed=3)
    loss_fn = make_loss_fn(batch)
    for _ in range(2):
        policy.train_step(batch, loss_fn, T, with_entropy=True)
    start, _, _, _ = hf_reference(dirs["a"], batch, T, grads=False)
    trained, _ = policy.compute_logprobs(batch, T, with_entropy=False)
    assert max_abs_diff(trained, start) > 1e-3  # the policy moved ...
    for ref in (from_ckpt, from_hf):  # ... the reference did not
        logps, _ = ref.compute_logprobs(batch, T)
        assert max_abs_diff(logps, start) < 2e-5


def test_offload_is_refused_on_cpu(dirs, groups):
    from megatron_rl.models.reference import ReferencePolicy

    with pytest.raises(ValueError, match="policy.reference.offload"):
        ReferencePolicy.from_hf(str(dirs["a"]), _cfg(offload=True), groups)


def test_logprob_phase_kl_reward_against_float64(dirs, groups):
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.algo.advantages import grpo_advantages_reference
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy
    from megatron_rl.trainer.grpo import add_logprobs

    policy = MegatronPolicy.from_hf(str(dirs["a"]), _cfg(), groups)
    ref = ReferencePolicy.from_hf(str(dirs["b"]), _cfg(), groups)
    algo = AlgoConfig.from_dict({"kl": {"enabled": True, "as_reward": True, "estimator": "k1",
                                        "coef": 0.1}})
    batch = _rl_batch()
    metrics = add_logprobs(policy, ref, batch, algo, T, version=0)

    lp_a, _, _, _ = hf_reference(dirs["a"], batch, T, grads=False)
    lp_b, _, _, _ = hf_reference(dirs["b"], batch, T, grads=False)
    assert max_abs_diff(batch.token_fields["old_logp"], lp_a) < 2e-5
    assert max_abs_diff(batch.token_fields["ref_logp"], lp_b) < 2e-5
    penalty = [0.1 * float((a - b).sum()) for a, b in zip(lp_a, lp_b)]
    # a small difference of two fp32 log-prob sums: its error is absolute (token errors < 2e-5)
    assert metrics["kl/reward_penalty_mean"] == pytest.approx(sum(penalty) / 6, rel=1e-4, abs=1e-6)
    rewards = [r - p for r, p in zip(batch.seq_fields["rewards"].tolist(), penalty)]
    want = grpo_advantages_reference(rewards, [0, 0, 0, 1, 1, 1], [True] * 6, norm_by_std=True,
                                     eps=1e-6)
    got = batch.seq_fields["advantages"].tolist()
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert any(abs(x) > 0.1 for x in got[3:])  # the all-correct group: separated by KL alone


def test_kl_loss_sees_the_reference_against_float64(dirs, groups):
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy
    from megatron_rl.trainer.grpo import add_logprobs, update_policy

    policy = MegatronPolicy.from_hf(str(dirs["a"]), _cfg(), groups)
    ref = ReferencePolicy.from_hf(str(dirs["b"]), _cfg(), groups)
    coef = 0.05
    algo = AlgoConfig.from_dict({"kl": {"enabled": True, "estimator": "k3_unclamped",
                                        "coef": coef}})
    batch = _rl_batch()
    batch.seq_fields["advantages"] = torch.tensor([0.5, -0.2, -0.3, 0.1, 0.0, -0.1])
    add_logprobs(policy, ref, batch, algo, T, version=0)
    assert "old_logp" not in batch.token_fields  # strictly on-policy: no recompute
    metrics, _ = update_policy(policy, batch, algo, T, alpha=0.0, max_response_len=20, seed=0)

    lp_a, _, _, _ = hf_reference(dirs["a"], batch, T, grads=False)
    lp_b, _, _, _ = hf_reference(dirs["b"], batch, T, grads=False)
    k3 = [torch.exp(b - a) - 1 - (b - a) for a, b in zip(lp_a, lp_b)]
    token_mean = float(sum(k.sum() for k in k3)) / sum(batch.response_lens)
    assert metrics["actor/kl"] == pytest.approx(token_mean, rel=1e-4)
    # the difference of two fp32 losses of size ~0.1-1: its rounding error is absolute (~1e-8)
    assert metrics["actor/loss"] - metrics["actor/pg_loss"] == pytest.approx(coef * token_mean,
                                                                             rel=1e-4, abs=3e-8)


def test_async_one_step_trains_stale_samples_without_a_recompute(dirs, groups):
    """One optimizer step (one pass, one mini-batch) on samples of older weights with TIS: the log-prob
    phase recomputes nothing, the update trains exactly as with recomputed old log-probs, and the
    train-inference gaps (overall and per staleness) come from the training forward, equal to float64."""
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.trainer.grpo import add_logprobs, update_policy

    algo = AlgoConfig.from_dict({"mismatch": {"mode": "tis_token", "tis_cap": 2.0}})
    lp, _, _, _ = hf_reference(dirs["a"], _rl_batch(), T, grads=False)
    gen = torch.Generator().manual_seed(4)

    def batch():
        b = _rl_batch()
        b.seq_fields["advantages"] = torch.tensor([0.5, -0.2, -0.3, 0.1, 0.0, -0.1])
        b.token_fields["rollout_logp"] = [x.float() + 0.3 * torch.randn(x.shape, generator=gen)
                                          for x in lp]
        # sequences 0-3 sampled one version before the trainer's (1), 4-5 by its own weights
        b.token_fields["weight_version"] = [torch.full((n,), 0 if i < 4 else 1, dtype=torch.long)
                                            for i, n in enumerate(b.response_lens)]
        return b

    skip, recompute = batch(), batch()
    recompute.token_fields["rollout_logp"] = skip.token_fields["rollout_logp"]
    a = MegatronPolicy.from_hf(str(dirs["a"]), _cfg(), groups)
    assert add_logprobs(a, None, skip, algo, T, version=1) == {}
    assert "old_logp" not in skip.token_fields
    got, _ = update_policy(a, skip, algo, T, alpha=0.0, max_response_len=20, seed=0, version=1)
    b = MegatronPolicy.from_hf(str(dirs["a"]), _cfg(), groups)
    recompute.token_fields["old_logp"] = b.compute_logprobs(recompute, T, with_entropy=False)[0]
    want, _ = update_policy(b, recompute, algo, T, alpha=0.0, max_response_len=20, seed=0, version=1)
    for key in ("actor/loss", "actor/pg_loss", "actor/tis_weight_mean", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert got["actor/first_step_ratio_min"] == got["actor/first_step_ratio_max"] == 1.0
    weights = dict(b.named_parameters())
    assert max(float((p - weights[n]).abs().max()) for n, p in a.named_parameters()) < 2e-5
    # the gaps, against float64 transformers
    rl = skip.token_fields["rollout_logp"]
    gap = [(x.double() - r.double()).abs() for x, r in zip(lp, rl)]
    assert got["rollout/train_infer_logp_gap"] == pytest.approx(
        sum(float(g.mean()) for g in gap) / len(gap), abs=2e-5)
    for d, rows in ((1, range(4)), (0, range(4, 6))):
        tokens = torch.cat([gap[i] for i in rows])
        assert got[f"async/logp_gap_staleness_{d}"] == pytest.approx(float(tokens.mean()), abs=2e-5)


def test_distill_teacher_scores_at_the_sampling_temperature_against_float64(dirs, groups):
    """On-policy distillation: the log-prob phase fills the teacher's log-probs of the sampled
    tokens at the sampling temperature (T = 0.7, not 1: the student's own are taken at T), equal to
    float64 transformers; the update's reverse KL is the token mean of log pi_s - log pi_T at T."""
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy
    from megatron_rl.trainer.grpo import add_logprobs, update_policy

    policy = MegatronPolicy.from_hf(str(dirs["a"]), _cfg(), groups)
    teacher = ReferencePolicy.from_hf(str(dirs["b"]), _cfg(), groups)
    algo = AlgoConfig.from_dict({"distill": {"coef": 1.0, "mode": "replace", "teacher": str(dirs["b"])}})
    batch = _rl_batch()
    add_logprobs(policy, None, batch, algo, T, version=0, teacher=teacher)
    lp_a, _, _, _ = hf_reference(dirs["a"], batch, T, grads=False)
    lp_b, _, _, _ = hf_reference(dirs["b"], batch, T, grads=False)
    lp_b1, _, _, _ = hf_reference(dirs["b"], batch, 1.0, grads=False)
    assert max_abs_diff(batch.token_fields["teacher_logp"], lp_b) < 2e-5
    assert max_abs_diff(lp_b, lp_b1) > 1e-2  # the temperature matters on these numbers
    metrics, _ = update_policy(policy, batch, algo, T, alpha=0.0, max_response_len=20, seed=0)
    token_mean = float(sum((a - b).sum() for a, b in zip(lp_a, lp_b))) / sum(batch.response_lens)
    assert metrics["distill/reverse_kl"] == pytest.approx(token_mean, rel=1e-4, abs=1e-6)
    assert metrics["distill/advantage_mean"] == pytest.approx(-token_mean, rel=1e-4, abs=1e-6)
