"""Our variants equal verl's own functions on the same inputs (verl 0.9.1's ``core_algos`` and its
DAPO reward manager, installed without its dependencies: the test extra adds the three small
packages its import needs). GSPO and CISPO (value and gradient, two aggregations), RLOO, REINFORCE++
(and -baseline), verl's pass@k advantage, and DAPO's soft overlong punishment."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.algo import AlgoConfig, compute_advantages, policy_objective, shape_rewards



def _import_verl():
    """verl's ``core_algos`` (scripts/bootstrap.sh installs verl with --no-deps; the test extra holds
    what its import needs). Its package import sets up the root logger: put that back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        from verl.trainer.ppo import core_algos
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return core_algos


core_algos = _import_verl()
F64 = torch.float64


def ours(**tree) -> AlgoConfig:
    cfg = AlgoConfig.from_dict(tree, prefix="algo")
    cfg.validate()
    return cfg


def verl_actor(eps_low, eps_high):
    from verl.workers.config import ActorConfig

    return ActorConfig(clip_ratio_low=eps_low, clip_ratio_high=eps_high, strategy="fsdp",
                       ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)


def random_batch(seed, b=5, T=7, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, T, generator=g, dtype=F64) * 2 - 0.05
    logp = old + spread * torch.randn(b, T, generator=g, dtype=F64)
    lens = torch.randint(1, T + 1, (b,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, old, mask, adv


@pytest.mark.parametrize("name", ["gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_and_cispo_equal_verls(name, agg):
    eps = (3e-2, 4e-2) if name == "gspo" else (0.2, 0.28)
    for seed in range(4):
        logp, old, mask, adv = random_batch(seed)
        a = ours(policy_loss=name, loss_agg=agg, clip={"eps_low": eps[0], "eps_high": eps[1]})
        lp = logp.clone().requires_grad_(True)
        loss, m = policy_objective(lp, old, adv, mask, a, token_denominator=float(mask.sum()),
                                   seq_denominator=float(mask.shape[0]))
        loss.backward()
        lv = logp.clone().requires_grad_(True)
        fn = core_algos.get_policy_loss_fn(name)
        v_loss, v_m = fn(old_log_prob=old, log_prob=lv, advantages=adv[:, None].expand_as(old) * mask,
                         response_mask=mask.to(F64), loss_agg_mode=agg, config=verl_actor(*eps))
        v_loss.backward()
        # verl divides a sequence's sum by (its token count + 1e-8): 1e-8 relative at most
        assert loss.item() == pytest.approx(v_loss.item(), rel=1e-8, abs=1e-12), seed
        torch.testing.assert_close(lp.grad, lv.grad * mask, rtol=2e-8, atol=1e-12)
        assert 0.0 <= m["actor/clipfrac_high"] + m["actor/clipfrac_low"] <= 1.0


def verl_advantage(name, rewards, gids, lengths, **algo):
    from verl.trainer.config import AlgoConfig as VerlAlgo

    T = max(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    scores = torch.zeros(len(rewards), T, dtype=F64)
    scores[torch.arange(len(rewards)), torch.tensor(lengths) - 1] = torch.tensor(rewards, dtype=F64)
    fn = core_algos.get_adv_estimator_fn(name)
    adv, _ = fn(token_level_rewards=scores, response_mask=mask, index=np.array(gids),
                config=VerlAlgo(gamma=1.0, **algo), epsilon=1e-6)
    assert torch.allclose(adv, adv[:, :1] * mask)  # one value per response
    return adv[:, 0].tolist()


CASES = [  # (rewards, group ids, response lengths): every group of two or more
    ([1.0, 0.0, 0.0, 1.0, 0.5, 0.2], [0, 0, 0, 0, 1, 1], [3, 5, 2, 7, 1, 4]),
    ([0.3, 0.9, 0.1, 0.7, 0.7, 0.0, 1.0, 0.2, 0.6], [4, 4, 4, 9, 9, 9, 2, 2, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9]),
]


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_rloo_reinforce_plus_plus_and_grpo_passk_equal_verls(name, case):
    rewards, gids, lengths = CASES[case]
    eps = 0.0 if name.startswith("reinforce") else 1e-6  # verl whitens with rsqrt(var + 1e-8)
    adv, _ = compute_advantages(torch.tensor(rewards, dtype=F64), torch.tensor(gids),
                                torch.zeros(len(rewards), dtype=torch.bool), ours(adv_estimator=name, adv_eps=eps),
                                lengths=torch.tensor(lengths, dtype=F64))
    want = verl_advantage(name, rewards, gids, lengths, norm_adv_by_std_in_grpo=True)
    assert adv.tolist() == pytest.approx(want, rel=1e-6, abs=1e-9)


class _Tokenizer:
    eos_token = "<eos>"

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def test_overlong_penalty_equals_verls_dapo_reward_manager():
    """verl's DAPORewardManager on responses of 1..12 tokens (scores 0 / 1 alternating), L_max 12,
    buffer 4, factor 0.7: the reward it puts on the last token equals our shaped reward."""
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    lengths = list(range(1, 13))
    scores = [float(i % 2) for i in range(12)]
    prompt_len, max_len = 3, 12
    responses = torch.arange(12 * max_len).reshape(12, max_len) % 50 + 1
    attention = torch.cat([torch.ones(12, prompt_len, dtype=torch.long),
                           (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]).long()], 1)
    data = DataProto.from_dict(
        tensors={"prompts": torch.ones(12, prompt_len, dtype=torch.long), "responses": responses,
                 "attention_mask": attention},
        non_tensors={"reward_model": np.array([{"ground_truth": str(i)} for i in range(12)], dtype=object),
                     "data_source": np.array(["demo"] * 12, dtype=object),
                     "extra_info": np.array([{"row": i} for i in range(12)], dtype=object)})
    manager = DAPORewardManager(
        tokenizer=_Tokenizer(), num_examine=0, max_resp_len=max_len,
        compute_score=lambda data_source, solution_str, ground_truth, extra_info: scores[int(ground_truth)],
        overlong_buffer_cfg=SimpleNamespace(enable=True, len=4, penalty_factor=0.7, log=False))
    verl_rewards = manager(data).sum(-1).tolist()
    shaped, _ = shape_rewards(torch.tensor(scores, dtype=F64), torch.arange(12) // 2,
                              torch.tensor(lengths, dtype=F64),
                              ours(shaping={"shapers": ["overlong"], "overlong_buffer": 4, "overlong_penalty": 0.7}),
                              max_response_len=max_len)
    assert shaped.tolist() == pytest.approx(verl_rewards, abs=1e-6)  # verl's reward tensor is float32
    assert min(verl_rewards[8:]) < 0  # the soft zone acted
