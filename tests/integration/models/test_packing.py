"""Packed sequences equal padded ones: log-probs, entropy, loss, per-sequence values and gradients
at TP1, TP2, PP2 and CP2 (x DP2), from the one ``torchrun`` launch of the parallel policy tests
(``parallel_run``: every other case of that launch packs, and is compared with transformers and with
the single-rank run in test_policy_parallel.py / test_context_parallel.py).

Tolerances (fp32, the two layouts sum in different orders): log-probs and entropy 3e-6 absolute;
summed loss 1e-6; gradients 1e-5 x the tensor's largest entry; weights after one Adam step (lr 1e-3)
1e-4 (Adam's first step is ~lr x sign, so summation noise on near-zero gradients shows).
"""

from __future__ import annotations

import pytest
import torch

from policy_testlib import max_abs_diff

pytestmark = pytest.mark.slow

# (worker directory, packed case, padded case)
PAIRS = {"tp1": ("policy", "tp1", "padded_tp1"), "tp2": ("policy", "tp2", "padded_tp2"),
         "pp2": ("policy", "pp2", "padded_pp2"), "cp2": ("cp", "cp2", "padded_cp2")}


@pytest.fixture(scope="module")
def load(parallel_run):
    out = parallel_run["out"]
    return lambda where, case: torch.load(out / where / f"{case}.pt", weights_only=False)


@pytest.mark.parametrize("layout", list(PAIRS))
def test_packed_sequences_equal_padded(layout, load):
    where, packed_case, padded_case = PAIRS[layout]
    packed, padded = load(where, packed_case), load(where, padded_case)
    # the two runs really laid the tokens out differently: one row of several sequences vs one
    # row per sequence
    assert all(p and shape[0] == 1 for p, shape in packed["shapes"])
    assert not any(p for p, _ in padded["shapes"])
    assert max(shape[0] for _, shape in padded["shapes"]) > 1
    assert sum(s[0] * s[1] for _, s in packed["shapes"]) < sum(s[0] * s[1] for _, s in padded["shapes"])
    assert [t.shape for t in packed["logps"]] == [t.shape for t in padded["logps"]]
    assert max_abs_diff(packed["logps"], padded["logps"]) < 3e-6
    assert max_abs_diff(packed["ents"], padded["ents"]) < 3e-6
    m, mp = packed["metrics"], padded["metrics"]
    assert m["loss"] == pytest.approx(mp["loss"], abs=1e-6)
    assert m["tokens"] == mp["tokens"]
    for name in ("logp", "ent"):
        a, b = packed["per_seq"][name], padded["per_seq"][name]
        assert torch.equal(a.isnan(), b.isnan())
        assert float((a - b).nan_to_num().abs().max()) < 3e-6
    assert m["grad_norm"] == pytest.approx(mp["grad_norm"], rel=1e-5)
    assert set(packed["grads"]) == set(padded["grads"])
    for name, ref in padded["grads"].items():
        err = float((packed["grads"][name].double() - ref.double()).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (name, err)
    worst = max(float((packed["weights"][n] - padded["weights"][n]).abs().max()) for n in padded["weights"])
    assert worst < 1e-4


def test_every_policy_loss_and_aggregation_packed_equals_padded(tmp_path, groups):
    """Every registered policy loss (sequence-level ones such as GSPO read per-sequence sums), every
    loss aggregation, and multi-turn loss masks, through the trainer's own objective (``phases.make_loss_fn``): packed and
    padded micro-batches (grouped differently: the packed plan balances by cost) give the same loss,
    metrics and gradients, single rank. Old log-probs off the current ones and engine log-probs off
    those, so ratios, clipping and the decoupled / TIS weights are not trivially 1. lr = 0: no step
    moves the weights between the cases."""
    from megatron_rl.algo import POLICY_LOSSES, AlgoConfig
    from megatron_rl.algo.aggregation import LOSS_AGG_MODES
    from megatron_rl.models import OptimConfig, PolicyConfig
    from megatron_rl.models.batch import LOSS_MASK
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.trainer.phases import make_loss_fn

    from policy_testlib import LENGTHS, PROMPTS, make_batch, write_hf_model

    hf = write_hf_model(tmp_path / "llama", "llama", tie=False, kv_heads=2)
    policies = {packed: MegatronPolicy.from_hf(str(hf), PolicyConfig(
        micro_batch_tokens=40, packed_sequences=packed, optim=OptimConfig(lr=0.0, clip_grad=0.0)), groups)
        for packed in (True, False)}
    batch = make_batch(LENGTHS * 2, PROMPTS * 2, seed=5)
    plans = {p: [(mb.layout.packed, sorted(mb.index)) for mb in policy._micro_batches(batch)]
             for p, policy in policies.items()}
    assert all(p for p, _ in plans[True]) and not any(p for p, _ in plans[False])
    assert [i for _, i in plans[True]] != [i for _, i in plans[False]]  # another grouping
    gen = torch.Generator().manual_seed(6)
    logp, _ = policies[False].compute_logprobs(batch, 0.7, with_entropy=False)
    batch.token_fields["old_logp"] = [x + 0.2 * torch.randn(x.shape, generator=gen) for x in logp]
    batch.token_fields["rollout_logp"] = [x + 0.3 * torch.randn(x.shape, generator=gen)
                                          for x in batch.token_fields["old_logp"]]
    batch.seq_fields["advantages"] = torch.randn(len(batch), generator=gen)
    cases = [{"policy_loss": name} for name in POLICY_LOSSES]
    cases += [{"policy_loss": "gspo", "loss_agg": agg} for agg in LOSS_AGG_MODES]
    cases += [{"mismatch": {"mode": "tis_token", "tis_cap": 2.0}}]
    # then multi-turn trajectories: a tool's observation tokens (loss_mask 0) are not trained on
    cases += [{"policy_loss": "gspo", "loss_mask": True}, {"policy_loss": "ppo_clip", "loss_mask": True}]
    for case in cases:
        if case.pop("loss_mask", False):
            batch.token_fields[LOSS_MASK] = [torch.rand(len(x), generator=gen) < 0.7 for x in logp]
        algo = AlgoConfig.from_dict({"entropy": {"mode": "fixed", "coef": 0.01}, **case})
        got = {}
        for packed, policy in policies.items():
            fn = make_loss_fn(batch, algo, alpha=0.01, max_response_len=20)
            metrics = policy.train_step(batch, fn, 0.7, with_entropy=True)
            got[packed] = metrics, dict(policy.export_hf_grads())
        (m, g), (mp, gp) = got[True], got[False]
        for key in ("actor/loss", "actor/pg_loss", "actor/ratio_mean", "actor/entropy", "grad_norm"):
            assert m[key] == pytest.approx(mp[key], rel=1e-5, abs=1e-7), (case, key)
        assert m["grad_norm"] > 0
        for name, ref in gp.items():
            err = float((g[name].double() - ref.double()).abs().max())
            assert err <= 1e-5 * float(ref.abs().max()) + 1e-9, (case, name, err)
        if LOSS_MASK in batch.token_fields and algo.policy_loss == "ppo_clip":
            # against float64: the clipped surrogate's token mean over the trained tokens only
            num = den = 0.0
            for lp, old, a, t in zip(logp, batch.token_fields["old_logp"], batch.seq_fields["advantages"],
                                     batch.token_fields[LOSS_MASK]):
                r = torch.exp(lp.double() - old.double())
                a = float(a)
                num += float(torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))[t].sum())
                den += int(t.sum())
            assert m["actor/pg_loss"] == pytest.approx(num / den, rel=1e-4, abs=1e-6)
