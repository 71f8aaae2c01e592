"""The algorithm variants of issues 29 / 31 against float64 references written from each paper's
formula (plain Python loops, subset enumeration), on hand-checkable numbers and random batches:
GSPO, CISPO, the decoupled PPO objective, RLOO, REINFORCE++ (and its baseline), pass@k (verl's
best-of-group and the analytic pass@k advantage), the reward shapers (DAPO overlong, Kimi length
penalty, pass@k reward), the entropy token masks and on-policy distillation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_rl.algo import (AlgoConfig, compute_advantages, distill_advantages, policy_objective,
                              shape_rewards, token_masks)
from megatron_rl.config.base import ConfigError

F64 = torch.float64


def cfg_of(**tree) -> AlgoConfig:
    cfg = AlgoConfig.from_dict(tree, prefix="algo")
    cfg.validate()
    return cfg


def batch(seed=0, b=4, T=6, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, T, generator=g, dtype=F64) * 2 - 0.05
    old = logp + spread * torch.randn(b, T, generator=g, dtype=F64)
    rollout = old + spread * torch.randn(b, T, generator=g, dtype=F64)
    lens = torch.randint(2, T + 1, (b,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, old.clamp(max=-1e-3), rollout.clamp(max=-1e-3), mask, adv


def objective(cfg, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_objective(lp, old, adv, mask, cfg, token_denominator=float(mask.sum()),
                               seq_denominator=float(mask.shape[0]), **kw)
    loss.backward()
    return loss.item(), lp.grad, m


def clip(x, lo, hi):
    return min(max(x, lo), hi)


# ------------------------------------------------------------------ policy losses
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_equals_the_sequence_level_objective(agg):
    """GSPO: s_i = exp(mean_t log r_t), loss_i = max(-A s_i, -A clip(s_i)); value and gradient
    from the paper's sequence objective (autograd through s_i itself) under each aggregation."""
    cfg = cfg_of(policy_loss="gspo", loss_agg=agg, clip={"eps_low": 0.05, "eps_high": 0.08})
    logp, old, _, mask, adv = batch(1, spread=0.1)
    value, grad, m = objective(cfg, logp, old, adv, mask)
    lp = logp.clone().requires_grad_(True)
    total, n_tok = 0.0, float(mask.sum())
    for i in range(mask.shape[0]):
        rows = mask[i].nonzero().flatten()
        s = torch.exp((lp[i, rows] - old[i, rows]).mean())
        a = float(adv[i])
        per_tok = torch.maximum(-a * s, -a * s.clamp(1 - 0.05, 1 + 0.08))
        # token-mean: every token of sequence i carries loss_i; seq-mean-token-mean: loss_i once
        total = total + (per_tok * len(rows) / n_tok if agg == "token-mean" else per_tok / mask.shape[0])
    total.backward()
    assert value == pytest.approx(total.item(), abs=1e-12)
    torch.testing.assert_close(grad, lp.grad.where(mask, 0.0), atol=1e-12, rtol=0)
    assert m["actor/seq_ratio"] > 0


def test_gspo_hand_numbers():
    """One sequence, log-ratios 0.2 and -0.1 (s = exp(0.05) = 1.0513), A = 1, clip 1.03: the
    loss is -1.03 and the gradient 0 (clipped); A = -1: loss 1.0513, gradient 1.0513 / 2 each."""
    cfg = cfg_of(policy_loss="gspo", loss_agg="seq-mean-token-mean", clip={"eps_low": 0.03, "eps_high": 0.03})
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    logp = old + torch.tensor([[0.2, -0.1]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    v, g, m = objective(cfg, logp, old, torch.tensor([1.0], dtype=F64), mask)
    assert v == pytest.approx(-1.03) and g.abs().max() == 0 and m["actor/clipfrac_high"] == 1.0
    v, g, _ = objective(cfg, logp, old, torch.tensor([-1.0], dtype=F64), mask)
    assert v == pytest.approx(math.exp(0.05)) and g[0].tolist() == pytest.approx([math.exp(0.05) / 2] * 2)


def test_cispo_keeps_every_tokens_gradient():
    """CISPO: loss_t = -sg(clip(r_t, 1 - el, 1 + eh)) A log pi(y_t): ratio 1.5 (clipped to 1.28),
    0.5 (to 0.8) and 1.0, A = 2: loss token mean -(1.28 + 0.8 + 1) * 2 * logp / 3, gradient
    -2 * w_t / 3 on EVERY token (PPO-clip would give 0 on the two clipped ones)."""
    cfg = cfg_of(policy_loss="cispo")
    logp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64)
    old = logp - torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    v, g, m = objective(cfg, logp, old, torch.tensor([2.0], dtype=F64), mask)
    w = [1.28, 0.8, 1.0]
    assert v == pytest.approx(sum(-wt * 2 * lp for wt, lp in zip(w, [-0.5, -1.0, -2.0])) / 3)
    assert g[0].tolist() == pytest.approx([-2 * wt / 3 for wt in w])
    assert m["actor/clipfrac_high"] == pytest.approx(1 / 3) and m["actor/clipfrac_low"] == pytest.approx(1 / 3)
    ppo_v, ppo_g, _ = objective(cfg_of(), logp, old, torch.tensor([2.0], dtype=F64), mask)
    assert ppo_g[0, 0] == 0 and ppo_g[0, 2] != 0  # the contrast: PPO drops the clipped token's gradient


def test_cispo_equals_the_per_token_reference_on_random_batches():
    cfg = cfg_of(policy_loss="cispo", clip={"eps_low": 0.3, "eps_high": 0.5})
    for seed in range(3):
        logp, old, _, mask, adv = batch(seed)
        v, g, _ = objective(cfg, logp, old, adv, mask)
        n = float(mask.sum())
        ref_v, ref_g = 0.0, torch.zeros_like(logp)
        for i, t in mask.nonzero().tolist():
            w = clip(math.exp(float(logp[i, t] - old[i, t])), 0.7, 1.5)
            ref_v += -w * float(adv[i]) * float(logp[i, t]) / n
            ref_g[i, t] = -w * float(adv[i]) / n
        assert v == pytest.approx(ref_v, abs=1e-12)
        torch.testing.assert_close(g, ref_g, atol=1e-12, rtol=0)


def decoupled_reference(logp, prox, behav, adv, mask, cap, over_cap, el=0.2, eh=0.28):
    """AReaL's decoupled PPO token by token: w = pi_prox / pi_behav (capped or masked above cap)
    times the clipped surrogate of r = pi_theta / pi_prox; token mean."""
    total, n = 0.0, float(mask.sum())
    for i, t in mask.nonzero().tolist():
        w = math.exp(float(prox[i, t] - behav[i, t]))
        w = min(w, cap) if over_cap == "truncate" else (w if w <= cap else 0.0)
        r = math.exp(float(logp[i, t] - prox[i, t]))
        a = float(adv[i])
        total += w * max(-a * r, -a * clip(r, 1 - el, 1 + eh)) / n
    return total


@pytest.mark.parametrize("over_cap", ["truncate", "mask"])
def test_decoupled_ppo_equals_the_float64_reference(over_cap):
    cfg = cfg_of(policy_loss="decoupled_ppo", decoupled={"cap": 1.3, "over_cap": over_cap})
    for seed in range(3):
        logp, prox, behav, mask, adv = batch(seed)
        v, _, m = objective(cfg, logp, prox, adv, mask, rollout_logp=behav)
        assert v == pytest.approx(decoupled_reference(logp, prox, behav, adv, mask, 1.3, over_cap), abs=1e-12)
        assert 0 < m["actor/decoupled_over_cap"] < 1


def test_decoupled_ppo_is_todays_loss_on_on_policy_batches():
    """Fresh samples (the engine's log-probs are the proximal policy's): exactly ppo_clip, value and
    gradient, whatever the cap; with stale samples and over_cap 'truncate' it is ppo_clip with
    tis_token (same cap), exactly."""
    for seed in range(3):
        logp, prox, behav, mask, adv = batch(seed)
        today = objective(cfg_of(), logp, prox, adv, mask)
        for cap, over in ((1.01, "truncate"), (1.01, "mask"), (5.0, "truncate")):
            dec = objective(cfg_of(policy_loss="decoupled_ppo", decoupled={"cap": cap, "over_cap": over}),
                            logp, prox, adv, mask, rollout_logp=prox.clone())
            assert dec[0] == today[0] and torch.equal(dec[1], today[1])
            assert dec[2]["actor/decoupled_weight"] == pytest.approx(today[2]["actor/ratio_mean"] * 0 + 1.0)
        dec = objective(cfg_of(policy_loss="decoupled_ppo", decoupled={"cap": 1.3}), logp, prox, adv, mask,
                        rollout_logp=behav)
        tis = objective(cfg_of(mismatch={"mode": "tis_token", "tis_cap": 1.3}), logp, prox, adv, mask,
                        rollout_logp=behav)
        assert dec[0] == pytest.approx(tis[0], abs=1e-15) and torch.allclose(dec[1], tis[1], atol=1e-15)


def test_decoupled_ppo_needs_the_engines_logprobs():
    logp, prox, _, mask, adv = batch(0)
    with pytest.raises(ValueError, match="^rollout_logp: policy_loss 'decoupled_ppo'"):
        objective(cfg_of(policy_loss="decoupled_ppo"), logp, prox, adv, mask)


@pytest.mark.parametrize("tree, key", [
    ({"policy_loss": "gspo", "mismatch": {"mode": "tis_token"}}, "algo.mismatch.mode"),
    ({"policy_loss": "gspo", "mismatch": {"mode": "icepop"}}, "algo.mismatch.mode"),
    ({"policy_loss": "decoupled_ppo", "mismatch": {"mode": "tis_token"}}, "algo.mismatch.mode"),
    ({"policy_loss": "cispo", "clip": {"dual_clip_c": 3.0}}, "algo.clip.dual_clip_c"),
    ({"policy_loss": "gspo", "clip": {"dual_clip_c": 3.0}}, "algo.clip.dual_clip_c"),
    ({"distill": {"coef": 1.0}}, "algo.distill.teacher"),
    ({"distill": {"teacher": "t"}}, "algo.distill.teacher"),
    ({"shaping": {"shapers": ["overlong", "overlong"]}}, "algo.shaping.shapers"),
    ({"shaping": {"shapers": ["too_long"]}}, "algo.shaping.shapers"),
    ({"token_mask": {"mode": "top"}}, "algo.token_mask.mode"),
])
def test_refused_combinations_are_named(tree, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        cfg_of(**tree)
    cfg_of(policy_loss="gspo", mismatch={"mode": "tis_seq"})  # the sequence-level weight applies


# ------------------------------------------------------------------ advantage estimators
def adv_of(name, rewards, gids, lengths=None, truncated=None, **tree):
    r = torch.tensor(rewards, dtype=F64)
    t = torch.zeros(len(rewards), dtype=torch.bool) if truncated is None else torch.tensor(truncated)
    adv, m = compute_advantages(r, torch.tensor(gids), t, cfg_of(adv_estimator=name, **tree),
                                lengths=None if lengths is None else torch.tensor(lengths, dtype=F64))
    return adv.tolist(), m


def test_rloo_leave_one_out_baseline():
    adv, _ = adv_of("rloo", [1.0, 0.0, 0.0, 1.0, 0.5, 0.2], [0, 0, 0, 0, 1, 1])
    assert adv == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.3, -0.3])
    g = torch.Generator().manual_seed(3)
    r = torch.rand(12, generator=g, dtype=F64).tolist()
    gids = [i // 4 for i in range(12)]
    adv, _ = adv_of("rloo", r, gids)
    for i in range(12):
        others = [r[j] for j in range(12) if gids[j] == gids[i] and j != i]
        assert adv[i] == pytest.approx(r[i] - sum(others) / len(others), abs=1e-12)


def whiten_reference(values, lengths, eps):
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mu = sum(tokens) / len(tokens)
    sd = math.sqrt(sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1))
    return [(v - mu) / (sd + eps) for v in values]


def test_reinforce_plus_plus_whitens_over_tokens():
    """Rewards 1, 0 with lengths 1, 3: token mean 0.25, unbiased token std sqrt(0.25) = 0.5, so the
    advantages are 1.5 and -0.5 (a sequence mean would give +-0.707)."""
    adv, _ = adv_of("reinforce_plus_plus", [1.0, 0.0], [0, 1], lengths=[1, 3], adv_eps=0.0)
    assert adv == pytest.approx([1.5, -0.5])
    r, gids, lens = [0.2, 0.9, 0.4, 1.0, 0.0, 0.3], [0, 0, 0, 1, 1, 1], [3, 5, 2, 7, 1, 4]
    adv, _ = adv_of("reinforce_plus_plus", r, gids, lengths=lens)
    assert adv == pytest.approx(whiten_reference(r, lens, 1e-6), abs=1e-12)
    base = [x - sum(r[3 * (i // 3):3 * (i // 3) + 3]) / 3 for i, x in enumerate(r)]
    adv, _ = adv_of("reinforce_plus_plus_baseline", r, gids, lengths=lens)
    assert adv == pytest.approx(whiten_reference(base, lens, 1e-6), abs=1e-12)
    with pytest.raises(ValueError, match="^lengths: this estimator whitens"):
        adv_of("reinforce_plus_plus", r, gids)


def test_grpo_passk_only_the_best_of_a_group():
    adv, _ = adv_of("grpo_passk", [0.2, 0.9, 0.5, 1.0, 0.0], [0, 0, 0, 1, 1])
    sd0 = torch.tensor([0.2, 0.9, 0.5], dtype=F64).std().item()
    assert adv == pytest.approx([0.0, 0.4 / (sd0 + 1e-6), 0.0, 1.0 / (math.sqrt(0.5) + 1e-6), 0.0])
    adv, _ = adv_of("grpo_passk", [0.2, 0.9, 0.5], [0, 0, 0], norm_adv_by_std=False)
    assert adv == pytest.approx([0.0, 0.4, 0.0])


def passk_enumerated(correct: list[bool], k: int) -> list[float]:
    """Every k-subset of the group scores max (1 if it holds a correct response); a response's
    advantage is the mean over the subsets that hold it of (score - mean) / std (population std
    over all subsets)."""
    n = len(correct)
    subsets = list(itertools.combinations(range(n), k))
    score = {s: float(any(correct[i] for i in s)) for s in subsets}
    mean = sum(score.values()) / len(subsets)
    sd = math.sqrt(sum((v - mean) ** 2 for v in score.values()) / len(subsets))
    if sd == 0:
        return [0.0] * n
    return [sum((score[s] - mean) / sd for s in subsets if i in s) / sum(1 for s in subsets if i in s)
            for i in range(n)]


def test_passk_analytic_equals_subset_enumeration():
    # hand: N 4, 2 wrong, k 2: mean 5/6, sd sqrt(5)/6, correct +0.4472, wrong -0.4472
    adv, _ = adv_of("passk", [1.0, 0.0, 0.0, 1.0], [0] * 4, adv_eps=0.0, passk={"k": 2})
    assert adv == pytest.approx([1 / math.sqrt(5), -1 / math.sqrt(5), -1 / math.sqrt(5), 1 / math.sqrt(5)])
    for n, k in ((6, 2), (8, 3), (8, 4), (5, 5), (7, 1)):
        for n_pos in range(n + 1):
            correct = [i < n_pos for i in range(n)]
            adv, _ = adv_of("passk", [float(c) for c in correct], [0] * n, adv_eps=0.0, passk={"k": k})
            assert adv == pytest.approx(passk_enumerated(correct, k), abs=1e-12), (n, k, n_pos)
    # k = 1 is GRPO with the population std
    adv, _ = adv_of("passk", [1.0, 0.0, 0.0, 0.0], [0] * 4, adv_eps=0.0, passk={"k": 1})
    assert adv == pytest.approx([0.75 / math.sqrt(3 / 16), -0.25 / math.sqrt(3 / 16)] + [-0.25 / math.sqrt(3 / 16)] * 2)


# ------------------------------------------------------------------ reward shapers
def shaped(rewards, gids, lengths, max_len=12, **shaping):
    cfg = cfg_of(shaping=shaping, passk={"k": shaping.pop("k", 2)} if "k" in shaping else {})
    r, m = shape_rewards(torch.tensor(rewards, dtype=F64), torch.tensor(gids),
                         torch.tensor(lengths, dtype=F64), cfg, max_response_len=max_len)
    return r.tolist(), m


def test_overlong_soft_punishment_dapo():
    """L_max 12, L_cache 4: L <= 8 -> 0; 10 -> (8 - 10) / 4 = -0.5; 12 -> -1; factor 0.5 halves it."""
    r, m = shaped([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], [8, 10, 12, 3], shapers=["overlong"], overlong_buffer=4)
    assert r == pytest.approx([1.0, 0.5, -1.0, 0.0]) and m["shaping/overlong_frac"] == 0.5
    r, _ = shaped([1.0, 1.0], [0, 0], [10, 12], shapers=["overlong"], overlong_buffer=4, overlong_penalty=0.5)
    assert r == pytest.approx([0.75, 0.5])
    for L in range(1, 13):  # the paper's piecewise R_length
        want = 0.0 if L <= 8 else (8 - L) / 4
        assert shaped([0.0, 0.0], [0, 0], [L, 1], shapers=["overlong"], overlong_buffer=4)[0][0] == pytest.approx(want)


def test_length_penalty_kimi():
    """Group lengths 2, 4, 6: lambda 0.5, 0, -0.5; correct keep lambda, wrong get min(0, lambda)."""
    r, _ = shaped([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [0, 0, 0, 1, 1, 1], [2, 4, 6, 5, 5, 5],
                  shapers=["length_penalty"], length_coef=0.2)
    assert r == pytest.approx([1.1, 1.0, -0.1, 0.0, 1.0, 0.0])
    r, _ = shaped([0.0, 0.0], [0, 0], [2, 6], shapers=["length_penalty"], length_coef=1.0)
    assert r == pytest.approx([0.0, -0.5])


def test_passk_reward_and_shapers_in_order():
    r, _ = shaped([0.0, 1.0, 0.0, 0.0, 0.0, 0.3, 1.0], [5, 5, 5, 5, 8, 8, 8], [3] * 7, shapers=["passk"], k=2)
    assert r == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.3, 0.3, 1.0])  # subgroups {0,1} {2,3} | {4,5} {6}
    # interleaved groups: positions count within each group
    r, _ = shaped([1.0, 0.0, 0.0, 0.0], [0, 1, 0, 1], [3] * 4, shapers=["passk"], k=2)
    assert r == pytest.approx([1.0, 0.0, 1.0, 0.0])
    # overlong then pass@k: the penalised reward is what the subgroup's max sees
    r, _ = shaped([1.0, 0.0], [0, 0], [12, 3], shapers=["overlong", "passk"], overlong_buffer=4, k=2)
    assert r == pytest.approx([0.0, 0.0])
    r, _ = shaped([1.0, 0.0], [0, 0], [12, 3], shapers=["passk", "overlong"], overlong_buffer=4, k=2)
    assert r == pytest.approx([0.0, 1.0])


def test_overlong_buffer_must_fit_the_stage():
    with pytest.raises(ValueError, match="^algo.shaping.overlong_buffer: must be in"):
        shaped([1.0, 0.0], [0, 0], [3, 4], max_len=4, shapers=["overlong"], overlong_buffer=4)


# ------------------------------------------------------------------ token masks
@pytest.mark.parametrize("mode", ["high_entropy", "low_entropy"])
def test_entropy_token_masks(mode):
    """Entropies of two responses, 0.1..1.0: the top (bottom) 20 % of the batch's 10 tokens are the
    two largest (smallest), wherever they sit."""
    ent = [torch.tensor([0.5, 0.9, 0.1]), torch.tensor([0.3, 1.0, 0.2, 0.8, 0.4, 0.6, 0.7])]
    masks, m = token_masks(ent, cfg_of(token_mask={"mode": mode, "frac": 0.2}).token_mask)
    flat = torch.cat(ent).tolist()
    order = sorted(range(10), key=lambda i: flat[i], reverse=mode == "high_entropy")
    keep = set(order[:2])
    assert torch.cat(masks).tolist() == [i in keep for i in range(10)]
    assert m["mask/kept_frac"] == 0.2
    masks, _ = token_masks([torch.ones(5)], cfg_of(token_mask={"mode": mode, "frac": 0.2}).token_mask)
    assert masks[0].all()  # ties at the threshold are kept


def test_token_mask_trains_only_the_kept_tokens():
    logp, old, _, mask, adv = batch(2)
    keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    full = objective(cfg_of(), logp, old, adv, mask)
    part = objective(cfg_of(), logp, old, adv, mask, token_mask=keep)
    assert torch.equal(part[1], torch.where(keep, full[1], 0.0))
    assert part[2]["actor/trained_token_frac"] == pytest.approx(float((keep & mask).sum() / mask.sum()))


# ------------------------------------------------------------------ on-policy distillation
@pytest.mark.parametrize("mode", ["add", "replace"])
def test_distill_advantage_is_the_negative_reverse_kl(mode):
    """A_t = [A] - coef * (log pi_old - log pi_teacher): old -1, teacher -0.5, coef 2 -> +1 added;
    old -0.2, teacher -1.2 -> -2 added."""
    cfg = cfg_of(distill={"coef": 2.0, "mode": mode, "teacher": "t"}, filter_zero_variance_groups=False)
    adv = torch.tensor([[0.3, 0.3]], dtype=F64)
    out, k = distill_advantages(adv, torch.tensor([[-1.0, -0.2]], dtype=F64),
                                torch.tensor([[-0.5, -1.2]], dtype=F64), torch.ones(1, 2, dtype=torch.bool),
                                cfg.distill)
    base = 0.3 if mode == "add" else 0.0
    assert out[0].tolist() == pytest.approx([base + 1.0, base - 2.0]) and k[0].tolist() == pytest.approx([-0.5, 1.0])


def test_distill_objective_equals_reference_and_pulls_toward_the_teacher():
    """REINFORCE on the distillation advantage alone is the reverse-KL policy gradient: per token
    -(-(old - teacher)) * r, i.e. loss token mean of (old - teacher) * r; its gradient raises
    log pi where the teacher is more likely than the student."""
    cfg = cfg_of(policy_loss="reinforce", distill={"coef": 1.0, "mode": "replace", "teacher": "t"},
                 filter_zero_variance_groups=False)
    logp, _, teacher, mask, adv = batch(4)
    v, g, m = objective(cfg, logp, logp.clone(), adv, mask, teacher_logp=teacher)
    n = float(mask.sum())
    ref = sum(float(logp[i, t] - teacher[i, t]) for i, t in mask.nonzero().tolist()) / n
    assert v == pytest.approx(ref, abs=1e-12) and m["distill/reverse_kl"] == pytest.approx(ref, abs=1e-12)
    want = torch.where(mask, (logp - teacher) / n, 0.0)
    torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="^teacher_logp: algo.distill.coef"):
        objective(cfg, logp, logp.clone(), adv, mask)
