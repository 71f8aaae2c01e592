"""On-policy distillation (algo.distill) against float64 references written from the papers' formula
(Agarwal et al. 2024, GKD; Thinking Machines 2025, "On-policy distillation"; Qwen3).

The objective: on the student's own samples y ~ pi_s (at the sampling temperature T), minimise the
per-token reverse KL to the teacher, sum_t KL(pi_s(.|y_<t) || pi_T(.|y_<t)), both distributions
at T, without differentiating through which prefixes were sampled. Its policy-gradient form: each
sampled token y_t gets the advantage -(log pi_s(y_t) - log pi_T(y_t)) (no baseline, its own
token's only: per-token credit), and the policy loss is trained on it. Checked here:

- the advantage equals that formula computed from the logits with plain Python math at T;
- for every policy loss, the EXPECTED gradient of the objective over all sampled sequences (exact
  enumeration of a 2-token, 4-symbol vocabulary, each weighted by its probability) equals the
  gradient of the per-token reverse KL itself (float64 autograd of the explicit sums), to 1e-12:
  a sign error, a teacher scored at another temperature or a per-sequence credit (every token given
  the sequence's summed KL) all fail it;
- groups whose rewards are all equal keep their tokens (they carry the teacher's signal) while
  the zero-variance filter is on.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_rl.algo import AlgoConfig, distill_advantages, filter_groups, policy_objective

F64 = torch.float64
V, TEMP = 4, 0.7


def cfg_of(**tree) -> AlgoConfig:
    cfg = AlgoConfig.from_dict(tree, prefix="algo")
    cfg.validate()
    return cfg


def log_softmax_reference(logits: list[float], temperature: float) -> list[float]:
    """log softmax(z / T) with plain Python math."""
    scaled = [z / temperature for z in logits]
    top = max(scaled)
    log_norm = top + math.log(sum(math.exp(s - top) for s in scaled))
    return [s - log_norm for s in scaled]


def test_distill_advantage_is_the_teachers_log_ratio_at_the_sampling_temperature():
    """A_t = [A_reward] - coef * (log pi_s(y_t) - log pi_T(y_t)), both log-probs of the sampled
    token at T, 0 at padding; k_t = log pi_s(y_t) - log pi_T(y_t) (its token mean over the
    student's samples estimates the reverse KL)."""
    g = torch.Generator().manual_seed(0)
    b, T = 3, 5
    student, teacher = (torch.randn(b, T, V, generator=g, dtype=F64) * 2 for _ in range(2))
    tokens = torch.randint(0, V, (b, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
    reward_adv = torch.randn(b, generator=g, dtype=F64)
    at_t = lambda z: torch.log_softmax(z / TEMP, -1).gather(-1, tokens[..., None])[..., 0]  # noqa: E731
    for mode, coef in (("replace", 1.0), ("add", 0.5)):
        cfg = cfg_of(distill={"coef": coef, "mode": mode, "teacher": "t"})
        adv, k = distill_advantages(reward_adv[:, None].expand(b, T), at_t(student), at_t(teacher), mask,
                                    cfg.distill)
        for i, t in itertools.product(range(b), range(T)):
            if not mask[i, t]:
                assert adv[i, t] == 0 and k[i, t] == 0
                continue
            y = int(tokens[i, t])
            want_k = (log_softmax_reference(student[i, t].tolist(), TEMP)[y]
                      - log_softmax_reference(teacher[i, t].tolist(), TEMP)[y])
            base = float(reward_adv[i]) if mode == "add" else 0.0
            assert float(k[i, t]) == pytest.approx(want_k, abs=1e-12)
            assert float(adv[i, t]) == pytest.approx(base - coef * want_k, abs=1e-12)


def _reverse_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(p / T) || softmax(q / T)) written out: sum_v p_v (log p_v - log q_v)."""
    lp = p_logits / TEMP - torch.logsumexp(p_logits / TEMP, -1, keepdim=True)
    lq = q_logits / TEMP - torch.logsumexp(q_logits / TEMP, -1, keepdim=True)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("loss", ["reinforce", "ppo_clip", "gspo", "cispo", "decoupled_ppo"])
def test_distill_expected_gradient_is_the_per_token_reverse_kl_gradient(loss):
    """Two response tokens, the second's logits depending on the first token. Over all V^2
    sequences, each weighted by its probability under the student at T, the policy loss on the
    distillation advantage (mode replace, coef 0.5, token-mean of the 2 tokens) has the expected
    gradient 0.5 * grad (KL_1 + E_{y_1 ~ pi_s}[KL_2(y_1)]) / 2 with the prefix distribution held
    fixed: the per-token reverse KL of the papers. A per-sequence credit would add
    E[KL_2(y_1) grad log pi_s(y_1)] to the first token's gradient; a teacher at T = 1 or a flipped
    sign change it too."""
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(V, generator=g, dtype=F64), torch.randn(V, V, generator=g, dtype=F64)
    w1, w2 = torch.randn(V, generator=g, dtype=F64) * 2, torch.randn(V, V, generator=g, dtype=F64) * 2
    z1.requires_grad_(True)
    z2.requires_grad_(True)
    coef = 0.5
    cfg = cfg_of(policy_loss=loss, distill={"coef": coef, "mode": "replace", "teacher": "t"})

    expected = torch.zeros((), dtype=F64)
    s1, s2 = torch.log_softmax(z1 / TEMP, -1), torch.log_softmax(z2 / TEMP, -1)
    t1, t2 = torch.log_softmax(w1 / TEMP, -1), torch.log_softmax(w2 / TEMP, -1)
    for a, b in itertools.product(range(V), range(V)):
        logp = torch.stack([s1[a], s2[a, b]])[None]
        teacher = torch.stack([t1[a], t2[a, b]])[None]
        prob = float(torch.exp(s1[a] + s2[a, b]))
        kw = {"rollout_logp": logp.detach()} if loss == "decoupled_ppo" else {}
        value, _ = policy_objective(logp, logp.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 2, dtype=torch.bool),
                                    cfg, teacher_logp=teacher, token_denominator=2.0, seq_denominator=1.0, **kw)
        expected = expected + prob * value
    got = torch.autograd.grad(expected, (z1, z2))

    p1 = torch.softmax(z1 / TEMP, -1).detach()  # the sampled prefix's distribution: no gradient
    objective = coef * (_reverse_kl(z1, w1) + (p1 * _reverse_kl(z2, w2)).sum()) / 2
    want = torch.autograd.grad(objective, (z1, z2))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    assert max(float(w.abs().max()) for w in want) > 0.05  # not a vacuous comparison


def test_distill_add_mode_sums_the_reward_and_teacher_gradients():
    """mode add: the gradient is the reward objective's plus coef times the replace objective's."""
    g = torch.Generator().manual_seed(2)
    b, T = 4, 3
    logp = -torch.rand(b, T, generator=g, dtype=F64) * 2 - 0.05
    teacher = -torch.rand(b, T, generator=g, dtype=F64) * 3 - 0.05
    mask = torch.ones(b, T, dtype=torch.bool)
    reward_adv = torch.randn(b, generator=g, dtype=F64)

    def grad(**tree):
        lp = logp.clone().requires_grad_(True)
        loss, _ = policy_objective(lp, logp, reward_adv, mask, cfg_of(**tree), teacher_logp=teacher,
                                   token_denominator=float(b * T), seq_denominator=float(b))
        return torch.autograd.grad(loss, lp)[0]

    add = grad(distill={"coef": 0.3, "mode": "add", "teacher": "t"})
    plain = grad()
    replace = grad(distill={"coef": 0.3, "mode": "replace", "teacher": "t"})
    torch.testing.assert_close(add, plain + replace, atol=1e-12, rtol=0)
    # per token: -(A_reward - 0.3 * (logp - teacher)) / n, the REINFORCE gradient of each token
    want = -(reward_adv[:, None] - 0.3 * (logp - teacher)) / (b * T)
    torch.testing.assert_close(add, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["add", "replace"])
def test_distill_keeps_groups_of_equal_rewards(mode):
    """With the zero-variance filter on, distillation keeps every group: an all-wrong or
    all-correct group has no reward signal but carries the teacher's. The counts still say how
    many groups had no reward variance."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    keep, m = filter_groups(rewards, gids, cfg_of())
    assert keep.tolist() == [True, True, False, False, False, False]  # plain GRPO drops them
    keep, m = filter_groups(rewards, gids, cfg_of(distill={"coef": 1.0, "mode": mode, "teacher": "t"}))
    assert keep.all()
    assert (m["filter/zero_variance"], m["filter/all_wrong"], m["filter/all_correct"]) == (2, 1, 1)
    assert m["filter/kept_groups"] == 3 and m["filter/kept_frac"] == 1.0
