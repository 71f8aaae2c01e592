"""The GRPO algorithm (Skywork-OR1 / DAPO recipe) as pure torch functions, no distributed state.

Advantage estimators and policy losses are registered by name; the config selects them.
"""

from megatron_rl.algo.registry import (ADV_ESTIMATORS, POLICY_LOSSES, register_adv_estimator,
                                       register_policy_loss)
from megatron_rl.algo.config import (AlgoConfig, ClipConfig, EntropyConfig, KLConfig,
                                     MismatchConfig)
from megatron_rl.algo.advantages import compute_advantages, grpo_advantages_reference
from megatron_rl.algo.filtering import filter_groups, filter_groups_reference
from megatron_rl.algo.policy_loss import ppo_clip_loss, reinforce_loss
from megatron_rl.algo.aggregation import LOSS_AGG_MODES, aggregate
from megatron_rl.algo.kl import kl_estimate, kl_reward_penalty
from megatron_rl.algo.mismatch import mismatch_weights
from megatron_rl.algo.entropy import EntropyController, sampled_entropy_surrogate
from megatron_rl.algo.objective import policy_objective
from megatron_rl.algo.schedule import sgd_schedule

__all__ = [
    "ADV_ESTIMATORS", "POLICY_LOSSES", "register_adv_estimator",
    "register_policy_loss", "AlgoConfig", "ClipConfig", "EntropyConfig", "KLConfig",
    "MismatchConfig", "compute_advantages", "grpo_advantages_reference", "filter_groups",
    "filter_groups_reference", "ppo_clip_loss", "reinforce_loss", "LOSS_AGG_MODES", "aggregate",
    "kl_estimate", "kl_reward_penalty", "mismatch_weights", "EntropyController",
    "sampled_entropy_surrogate", "policy_objective", "sgd_schedule",
]
