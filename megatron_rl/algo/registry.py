"""The algorithm's registries: advantage estimators, policy losses, reward shapers and token masks.

A new variant is one decorated function; the config names it, the trainer looks it up by name.
The built-in variants are declared here with their module, so a config's choice is checked without
importing torch (their modules import it at the first lookup).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_rl.common.registry import Registry

# fn(rewards: float64[B], groups: algo.advantages.Groups, cfg: AlgoConfig) -> float64[B]
#    advantages (groups: index [B] in [0, num_groups), in_stats bool [B], lengths [B] or None).
ADV_ESTIMATORS: Registry[Callable] = Registry(
    "advantage estimator", declared=dict.fromkeys(
        ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
         "grpo_passk", "passk"], "megatron_rl.algo.advantages"))
# fn(t: algo.policy_loss.PolicyTokens, cfg: AlgoConfig) -> (per-token loss [b,T],
#    {event name: bool[b,T]}), events counted over valid tokens as fractions (e.g. clipfrac_low).
POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss", declared=dict.fromkeys(["ppo_clip", "reinforce", "gspo", "cispo", "decoupled_ppo"],
                                          "megatron_rl.algo.policy_loss"))
# fn(rewards: float64[B], s: algo.shaping.ShapingInputs, cfg: AlgoConfig) -> (float64[B] shaped
#    rewards, metrics); applied in the order algo.shaping.shapers names them.
REWARD_SHAPERS: Registry[Callable] = Registry(
    "reward shaper", declared=dict.fromkeys(["overlong", "length_penalty", "passk"],
                                            "megatron_rl.algo.shaping"))
# fn(entropy: float[N] (the batch's valid tokens, flattened), frac: float) -> bool[N] trained tokens.
TOKEN_MASKS: Registry[Callable] = Registry(
    "token mask", declared=dict.fromkeys(["high_entropy", "low_entropy"], "megatron_rl.algo.token_mask"))


def register_adv_estimator(name: str) -> Callable[[Callable], Callable]:
    return ADV_ESTIMATORS.register(name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    return POLICY_LOSSES.register(name)


def register_reward_shaper(name: str) -> Callable[[Callable], Callable]:
    return REWARD_SHAPERS.register(name)


def register_token_mask(name: str) -> Callable[[Callable], Callable]:
    return TOKEN_MASKS.register(name)
