"""Adaptive entropy control (Skywork-OR1) step by step, its checkpoint state, and the
sampled-token entropy surrogate's gradient against the exact entropy gradient."""

import pytest
import torch

from megatron_rl.algo import EntropyConfig, EntropyController, sampled_entropy_surrogate


def adaptive(**kw):
    cfg = EntropyConfig(mode="adaptive", coef=0.0, target=0.2, delta=0.01, coef_min=0.0,
                        coef_max=0.025, **kw)
    cfg.validate()
    return EntropyController(cfg)


def test_adaptive_sequence_hand_computed():
    ctl = adaptive()
    # (entropy, alpha used this step, coefficient state after the step)
    steps = [(0.1, 0.0, 0.01),      # below target: the term applies with c_0 = 0, c grows
             (0.1, 0.01, 0.02),
             (0.1, 0.02, 0.025),    # clamped at coef_max
             (0.1, 0.025, 0.025),
             (0.3, 0.0, 0.015),     # above target: no term, c shrinks
             (0.2, 0.015, 0.015),   # at target: the term applies, c holds
             (0.5, 0.0, 0.005),
             (0.5, 0.0, 0.0),       # clamped at coef_min
             (0.5, 0.0, 0.0),
             (0.19, 0.0, 0.01)]
    for entropy, alpha, state in steps:
        metrics = ctl.update(entropy)
        assert ctl.alpha == pytest.approx(alpha) and metrics["actor/entropy_coef"] == ctl.alpha
        assert metrics["actor/entropy_coef_state"] == pytest.approx(state)
        assert metrics["actor/entropy_below_target"] == float(entropy <= 0.2)


def test_fixed_and_off_modes():
    fixed = EntropyController(EntropyConfig(mode="fixed", coef=0.003))
    assert fixed.alpha == 0.003
    for entropy in (0.01, 5.0):
        fixed.update(entropy)
        assert fixed.alpha == 0.003
    off = EntropyController(EntropyConfig(mode="off", coef=0.003))
    off.update(0.01)
    assert off.alpha == 0.0


def test_state_round_trip_resumes_the_same_trajectory():
    entropies = [0.1, 0.15, 0.3, 0.05, 0.1, 0.4, 0.1]
    straight = adaptive()
    alphas = [(straight.update(e), straight.alpha)[1] for e in entropies]
    first = adaptive()
    for e in entropies[:3]:
        first.update(e)
    resumed = adaptive()
    resumed.load_state_dict(first.state_dict())
    assert resumed.alpha == first.alpha
    assert [(resumed.update(e), resumed.alpha)[1] for e in entropies[3:]] == alphas[3:]
    assert resumed.state_dict()["steps"] == len(entropies)


def test_bad_state_and_entropy_refused():
    ctl = adaptive()
    with pytest.raises(ValueError, match="^state:.*lacks"):
        ctl.load_state_dict({"coef": 0.1})
    with pytest.raises(ValueError, match="algo.entropy.mode"):
        ctl.load_state_dict({**EntropyController(EntropyConfig(mode="fixed")).state_dict()})
    with pytest.raises(ValueError, match="^mean_entropy:"):
        ctl.update(float("nan"))


def test_sampled_surrogate_gradient_is_the_entropy_gradient():
    """Weighting the surrogate of every token a by pi(a) (the exact expectation over samples)
    gives exactly grad H(pi) = grad(-sum pi log pi) at pi_old = pi."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp().detach()
    surrogate = (probs * sampled_entropy_surrogate(logp, logp - logp.detach())).sum()
    (got,) = torch.autograd.grad(surrogate, logits)
    exact = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum()
    (want,) = torch.autograd.grad(exact, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert surrogate.item() == pytest.approx(exact.item())
