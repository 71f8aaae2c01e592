"""The algorithm's registries: advantage estimators and policy losses, by name.

A new variant is one decorated function; the config names it, the trainer looks it up by name.
The built-in variants are declared here with their module, so a config's choice is checked without
importing torch (their modules import it at the first lookup).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_rl.common.registry import Registry

# fn(rewards: float64[B], group_index: long[B] in [0, num_groups), in_stats: bool[B],
#    num_groups: int, cfg: AlgoConfig) -> float64[B] advantages.
ADV_ESTIMATORS: Registry[Callable] = Registry(
    "advantage estimator", declared=dict.fromkeys(["grpo", "dr_grpo"], "megatron_rl.algo.advantages"))
# fn(log_ratio: [b,T], advantages: [b,T], cfg: AlgoConfig) -> (per-token loss [b,T],
#    {event name: bool[b,T]}), events counted over valid tokens as fractions (e.g. clipfrac_low).
POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss", declared=dict.fromkeys(["ppo_clip", "reinforce"], "megatron_rl.algo.policy_loss"))


def register_adv_estimator(name: str) -> Callable[[Callable], Callable]:
    return ADV_ESTIMATORS.register(name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    return POLICY_LOSSES.register(name)
