"""policy_objective against a float64 per-token loop reference (value and gradient), hand-computed
cases, the SFT identity (advantage 1 on every sample), split invariance over micro-batches / DP ranks, bad arguments."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from megatron_rl.algo import AlgoConfig, policy_objective

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MISMATCH_MODES = ["none", "tis_token", "tis_seq", "icepop"]
KL_ESTIMATORS = ["k1", "k2", "k3_unclamped", "low_var_kl"]


def make_cfg(loss_agg="token-mean", dual_clip_c=None, policy_loss="ppo_clip", mismatch="none",
             kl=None, entropy="off", estimator="full") -> AlgoConfig:
    cfg = AlgoConfig.from_dict({
        "loss_agg": loss_agg, "policy_loss": policy_loss,
        "clip": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": dual_clip_c},
        "mismatch": {"mode": mismatch, "tis_cap": 1.5, "icepop_low": 0.7, "icepop_high": 1.4},
        "kl": {"enabled": kl is not None, "estimator": kl or "k1", "coef": 0.3},
        "entropy": {"mode": entropy, "coef": 0.05, "estimator": estimator}}, prefix="algo")
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- the float64 loop reference
def reference_token_loss(r, A, cfg):
    """Textbook piecewise PPO: A >= 0 -> -A min(r, 1+eh); A < 0 -> |A| min(max(r, 1-el), c)."""
    if cfg.policy_loss == "reinforce":
        return -A * r
    hi, lo, c = 1 + cfg.clip.eps_high, 1 - cfg.clip.eps_low, cfg.clip.dual_clip_c
    if A >= 0:
        return -A * (r if r.item() <= hi else torch.tensor(hi, dtype=r.dtype))
    inner = r if r.item() >= lo else torch.tensor(lo, dtype=r.dtype)
    if c is not None and inner.item() > c:
        inner = torch.tensor(c, dtype=r.dtype)
    return -A * inner


def reference_weights(old, rollout, mask, cfg):
    b, T = old.shape
    w = [[1.0] * T for _ in range(b)]
    m = cfg.mismatch
    for i in range(b):
        rows = [t for t in range(T) if mask[i, t]]
        seq = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in rows))
        for t in rows:
            k = math.exp(float(old[i, t] - rollout[i, t]))
            if m.mode == "tis_token":
                w[i][t] = min(k, m.tis_cap)
            elif m.mode == "tis_seq":
                w[i][t] = min(seq, m.tis_cap)
            elif m.mode == "icepop":
                w[i][t] = k if m.icepop_low <= k <= m.icepop_high else 0.0
    return w


def reference_kl(lp, ref, estimator):
    d = ref - lp  # log(ref / pi)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    k3 = torch.exp(d) - d - 1
    return k3.clamp(-10, 10) if estimator == "low_var_kl" else k3


def reference_agg(terms, mask, cfg, max_len):
    """terms[i][t]: scalar tensors; aggregate over the WHOLE batch given here."""
    b, T = mask.shape
    rows = [[terms[i][t] for t in range(T) if mask[i, t]] for i in range(b)]
    n_tokens = sum(len(r) for r in rows)
    n_seqs = sum(1 for r in rows if r)
    if cfg.loss_agg == "token-mean":
        return sum(sum(r) for r in rows if r) / n_tokens
    if cfg.loss_agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seqs
    return sum(sum(r) / max_len for r in rows if r) / n_seqs


def reference_objective(logp, old, adv, mask, cfg, *, entropy=None, alpha=0.0, rollout=None,
                        ref=None, max_len=None):
    b, T = logp.shape
    A = adv if adv.dim() == 2 else adv[:, None].expand(b, T)
    w = reference_weights(old, rollout, mask, cfg) if cfg.mismatch.mode != "none" else None
    pg, ent, kl = [], [], []
    for i in range(b):
        pg.append([]), ent.append([]), kl.append([])
        for t in range(T):
            r = torch.exp(logp[i, t] - old[i, t])
            term = reference_token_loss(r, float(A[i, t]), cfg)
            pg[i].append(term * w[i][t] if w is not None else term)
            if cfg.entropy.estimator == "sampled":
                ent[i].append(-r * logp[i, t].detach())
            elif entropy is not None:
                ent[i].append(entropy[i, t])
            if ref is not None:
                kl[i].append(reference_kl(logp[i, t], ref[i, t], cfg.kl.estimator))
    loss = reference_agg(pg, mask, cfg, max_len)
    if alpha:
        loss = loss - alpha * reference_agg(ent, mask, cfg, max_len)
    if cfg.kl.enabled:
        loss = loss + cfg.kl.coef * reference_agg(kl, mask, cfg, max_len)
    return loss


def random_batch(b, T, seed, adv_per_token=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = (-torch.rand(b, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.35 * torch.randn(b, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(b, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(b, T, generator=g, dtype=torch.float64)
    entropy = (torch.rand(b, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    shape = (b, T) if adv_per_token else (b,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    # padding holds garbage that must not leak into the loss or its gradient
    with torch.no_grad():
        logp[~mask] = -torch.inf
    old[~mask] = float("nan")
    return dict(logp=logp, old=old, rollout=rollout, ref=ref, entropy=entropy, adv=adv, mask=mask)


def run_both(d, cfg, alpha, max_len=9):
    kw = dict(entropy=d["entropy"], alpha=alpha, rollout_logp=d["rollout"], ref_logp=d["ref"])
    mask = d["mask"]
    loss, metrics = policy_objective(d["logp"], d["old"], d["adv"], mask, cfg, **kw,
                                     token_denominator=float(mask.sum()),
                                     seq_denominator=float(mask.any(-1).sum()),
                                     max_response_len=max_len)
    got = torch.autograd.grad(loss, [d["logp"], d["entropy"]], allow_unused=True)
    ref = reference_objective(d["logp"], d["old"], d["adv"], mask, cfg, entropy=d["entropy"],
                              alpha=alpha, rollout=d["rollout"],
                              ref=d["ref"] if cfg.kl.enabled else None, max_len=max_len)
    want = torch.autograd.grad(ref, [d["logp"], d["entropy"]], allow_unused=True)
    return loss, ref, got, want, metrics


def assert_grads_equal(got, want, mask):
    for g, w in zip(got, want):
        g = torch.zeros_like(mask, dtype=torch.float64) if g is None else g
        w = torch.zeros_like(mask, dtype=torch.float64) if w is None else w
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mismatch", MISMATCH_MODES)
def test_matches_reference_with_every_term_on(agg, mismatch):
    d = random_batch(5, 7, seed=10 * AGG_MODES.index(agg) + MISMATCH_MODES.index(mismatch),
                     adv_per_token=True)
    cfg = make_cfg(agg, dual_clip_c=2.0, mismatch=mismatch, kl="low_var_kl", entropy="fixed")
    loss, ref, got, want, metrics = run_both(d, cfg, alpha=0.05)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    assert_grads_equal(got, want, d["mask"])
    assert metrics["actor/clipfrac_low"] + metrics["actor/clipfrac_high"] > 0  # clipping exercised


@settings(max_examples=80, deadline=None)
@given(agg=st.sampled_from(AGG_MODES), dual=st.sampled_from([None, 1.5, 3.0]),
       loss=st.sampled_from(["ppo_clip", "reinforce"]), mismatch=st.sampled_from(MISMATCH_MODES),
       kl=st.sampled_from([None] + KL_ESTIMATORS),
       entropy=st.sampled_from([("off", "full", 0.0), ("fixed", "full", 0.05),
                                ("fixed", "sampled", 0.05), ("adaptive", "full", 0.02)]),
       per_token=st.booleans(), seed=st.integers(0, 10_000))
def test_matches_reference_for_every_mode(agg, dual, loss, mismatch, kl, entropy, per_token, seed):
    mode, estimator, alpha = entropy
    d = random_batch(4, 6, seed, adv_per_token=per_token)
    cfg = make_cfg(agg, dual if loss == "ppo_clip" else None, loss, mismatch, kl, mode, estimator)
    value, ref, got, want, _ = run_both(d, cfg, alpha)
    assert value.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    assert_grads_equal(got, want, d["mask"])


def test_hand_computed_clip_higher_and_dual_clip():
    # eps 0.2 / 0.28, c = 3. Tokens (A, r): (+1, 1.5) high-clipped -> -1.28; (-1, 0.5) low-clipped
    # -> 0.8; (-1, 4) dual-clipped -> 3; (+1, 1) -> -1; (-2, 1.1) -> 2.2. Token mean 3.72 / 5.
    adv = torch.tensor([[1.0, -1, -1, 1, -2]], dtype=torch.float64)
    ratio = torch.tensor([[1.5, 0.5, 4.0, 1.0, 1.1]], dtype=torch.float64)
    logp = torch.zeros(1, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, m = policy_objective(logp, -ratio.log(), adv, mask, make_cfg(dual_clip_c=3.0),
                               token_denominator=5, seq_denominator=1)
    assert loss.item() == pytest.approx(3.72 / 5)
    loss.backward()  # d/dlogp of -A r = -A r on unclipped tokens, 0 on clipped ones
    assert logp.grad[0].tolist() == pytest.approx([0, 0, 0, -1 / 5, 2.2 / 5])
    assert (m["actor/clipfrac_high"], m["actor/clipfrac_low"], m["actor/clipfrac_dual"]) == \
        pytest.approx((0.2, 0.2, 0.2))
    assert (m["actor/ratio_min"], m["actor/ratio_max"]) == pytest.approx((0.5, 4.0))
    assert m["actor/ratio_mean"] == pytest.approx(8.1 / 5)


def test_hand_computed_aggregation_modes():
    # loss per token = -A r with r = 1 (on-policy, no clipping): the advantages negated.
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    logp = torch.zeros(2, 3, dtype=torch.float64)
    expected = {"token-mean": -(1 + 2 + 3 + 4) / 4,            # DAPO: longer answers weigh more
                "seq-mean-token-mean": -(2 + 4) / 2,          # GRPO: every answer weighs the same
                "seq-mean-token-sum-norm": -(6 / 10 + 4 / 10) / 2}  # Dr.GRPO, max length 10
    for agg, value in expected.items():
        loss, _ = policy_objective(logp, logp, adv, mask, make_cfg(agg), token_denominator=4,
                                   seq_denominator=2, max_response_len=10)
        assert loss.item() == pytest.approx(value), agg


def test_hand_computed_tis_and_icepop():
    # old - rollout = log 3 and log 0.5 on the two tokens of one sequence; A = -1, r = 1.
    old = torch.zeros(1, 2, dtype=torch.float64)
    rollout = -torch.tensor([[math.log(3), math.log(0.5)]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = -torch.ones(1, dtype=torch.float64)
    cases = {"tis_token": (1.5 + 0.5) / 2,   # min(3, 1.5), min(0.5, 1.5)
             "tis_seq": (1.5 + 1.5) / 2,     # min(3 * 0.5, 1.5) on both tokens
             "icepop": (0 + 0) / 2}          # 3 > 1.4 and 0.5 < 0.7: both masked
    for mode, value in cases.items():
        loss, m = policy_objective(old, old, adv, mask, make_cfg(mismatch=mode),
                                   rollout_logp=rollout, token_denominator=2, seq_denominator=1)
        assert loss.item() == pytest.approx(value), mode
        assert m["actor/tis_weight_mean"] == pytest.approx(value), mode
    assert m["actor/masked_frac"] == 1.0
    rollout = -torch.tensor([[math.log(1.2), math.log(0.5)]], dtype=torch.float64)
    _, m = policy_objective(old, old, adv, mask, make_cfg(mismatch="icepop"),
                            rollout_logp=rollout, token_denominator=2, seq_denominator=1)
    assert m["actor/masked_frac"] == 0.5 and m["actor/tis_weight_max"] == pytest.approx(1.2)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sft_is_rl_with_advantage_one(agg):
    """Seed 002: SFT = this objective with A = 1 and old_logp = logp.detach(); same gradient."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    loss, _ = policy_objective(logp, logp.detach(), torch.ones(3, dtype=torch.float64), mask,
                               make_cfg(agg), token_denominator=float(mask.sum()),
                               seq_denominator=3.0)
    (grad,) = torch.autograd.grad(loss, logits)
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    if agg == "token-mean":
        ref_loss = nll[mask].mean()
    else:
        ref_loss = torch.stack([nll[i][mask[i]].mean() for i in range(3)]).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    assert loss.item() == pytest.approx(-1.0)  # value: -A r = -1 per token (the gradient matters)


# ------------------------------------------------- split invariance: micro-batches and DP ranks
def tiny_policy(w, feats, tokens):
    """A one-matrix policy: token log-probs and full-vocabulary entropies, differentiable in w."""
    logprobs = torch.log_softmax(feats @ w, -1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, tokens[..., None])[..., 0], entropy


@settings(max_examples=40, deadline=None)
@given(agg=st.sampled_from(AGG_MODES), mismatch=st.sampled_from(MISMATCH_MODES),
       kl=st.sampled_from([None, "k3_unclamped"]), entropy=st.sampled_from(["off", "full", "sampled"]),
       b=st.integers(1, 8), T=st.integers(1, 6), seed=st.integers(0, 10_000), data=st.data())
def test_loss_and_gradient_independent_of_split(agg, mismatch, kl, entropy, b, T, seed, data):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    feats = torch.randn(b, T, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (b, T), generator=g)
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    with torch.no_grad():
        base, _ = tiny_policy(weight, feats, tokens)
    old = base + 0.4 * torch.randn(b, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(b, T, generator=g, dtype=torch.float64)
    ref = base + 0.3 * torch.randn(b, T, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mode, estimator = ("off", "full") if entropy == "off" else ("fixed", entropy)
    cfg = make_cfg(agg, 2.5, mismatch=mismatch, kl=kl, entropy=mode, estimator=estimator)
    alpha = 0.0 if entropy == "off" else 0.05
    denominators = dict(token_denominator=float(mask.sum()), seq_denominator=float(b),
                        max_response_len=T + 2)

    def objective(w, rows):
        logp, ent = tiny_policy(w, feats[rows], tokens[rows])
        return policy_objective(logp, old[rows], adv[rows], mask[rows], cfg, entropy=ent,
                                alpha=alpha, rollout_logp=rollout[rows], ref_logp=ref[rows],
                                **denominators)

    whole_loss, whole_metrics = objective(weight, slice(None))
    (whole_grad,) = torch.autograd.grad(whole_loss, weight)

    # Split rows over DP ranks, then each rank's rows into micro-batches.
    ranks = data.draw(st.integers(1, b))
    rank_cuts = sorted(data.draw(st.sets(st.integers(1, b - 1), min_size=ranks - 1,
                                         max_size=ranks - 1))) if b > 1 else []
    bounds = [0, *rank_cuts, b]
    total_loss, grad_sum, metric_parts = 0.0, torch.zeros_like(weight), []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        replica = weight.detach().clone().requires_grad_()  # this rank's copy of the weights
        cuts = sorted(data.draw(st.sets(st.integers(lo + 1, hi - 1), max_size=hi - lo - 1))) \
            if hi - lo > 1 else []
        for m_lo, m_hi in zip([lo, *cuts], [*cuts, hi]):
            loss, metrics = objective(replica, slice(m_lo, m_hi))
            loss.backward()  # gradient accumulation over micro-batches
            total_loss += loss.item()
            metric_parts.append(metrics)
        grad_sum += replica.grad  # all-reduce (sum) over DP ranks
    assert total_loss == pytest.approx(whole_loss.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad_sum, whole_grad, rtol=1e-9, atol=1e-12)

    for key, value in whole_metrics.items():
        parts = [m[key] for m in metric_parts if key in m]
        reduced = min(parts) if key.endswith("_min") else max(parts) if key.endswith("_max") \
            else sum(parts)
        assert reduced == pytest.approx(value, rel=1e-9, abs=1e-12), key


# ------------------------------------------------------------------------------ bad arguments
def good_args():
    logp = torch.zeros(2, 3)
    return dict(logp=logp, old_logp=logp, advantages=torch.ones(2),
                mask=torch.ones(2, 3, dtype=torch.bool), cfg=make_cfg(), token_denominator=6,
                seq_denominator=2)


@pytest.mark.parametrize("change, name", [
    (dict(mask=torch.zeros(2, 3, dtype=torch.bool)), "mask"),
    (dict(mask=torch.ones(2, 3)), "mask"),
    (dict(old_logp=torch.zeros(2, 4)), "old_logp"),
    (dict(logp=torch.zeros(6)), "logp"),
    (dict(advantages=torch.ones(3)), "advantages"),
    (dict(token_denominator=5), "token_denominator"),
    (dict(seq_denominator=1), "seq_denominator"),
    (dict(cfg=make_cfg("seq-mean-token-sum-norm")), "max_response_len"),
    (dict(cfg=make_cfg(mismatch="tis_token")), "rollout_logp"),
    (dict(cfg=make_cfg(kl="k3_unclamped")), "ref_logp"),
    (dict(cfg=make_cfg(entropy="fixed")), "entropy"),
    (dict(alpha=0.1), "alpha"),
    (dict(alpha=-0.1, cfg=make_cfg(entropy="fixed", estimator="sampled")), "alpha"),
    (dict(cfg=AlgoConfig(loss_agg="token-sum")), "algo.loss_agg"),
    (dict(cfg=AlgoConfig(policy_loss="ppo")), "algo.policy_loss"),
    (dict(cfg=AlgoConfig(mismatch={"mode": "tis"}), rollout_logp=torch.zeros(2, 3)),
     "algo.mismatch.mode"),
    (dict(cfg=AlgoConfig(kl={"enabled": True, "estimator": "k9"}), ref_logp=torch.zeros(2, 3)),
     "algo.kl.estimator"),
])
def test_bad_arguments_name_the_argument(change, name):
    args = {**good_args(), **change}
    for key in ("mismatch", "kl"):  # let the unchecked config objects through as plain configs
        sub = getattr(args["cfg"], key)
        if isinstance(sub, dict):
            setattr(args["cfg"], key, type(getattr(AlgoConfig(), key))(**sub))
    with pytest.raises(ValueError, match=f"^{name}:"):
        policy_objective(**args)
