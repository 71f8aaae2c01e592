"""The GRPO algorithm (Skywork-OR1 / DAPO recipe) as pure torch functions, no distributed state.

Advantage estimators, policy losses, reward shapers and token masks are registered by name; the
config selects them. The names
below are imported at their first use (``common.lazy``): ``megatron_rl.algo.config`` (and the run
schema above it) loads and validates without importing torch.
"""

from megatron_rl.common.lazy import lazy_exports

_EXPORTS = {
    "ADV_ESTIMATORS": "registry", "POLICY_LOSSES": "registry", "register_adv_estimator": "registry",
    "register_policy_loss": "registry", "REWARD_SHAPERS": "registry", "TOKEN_MASKS": "registry",
    "register_reward_shaper": "registry", "register_token_mask": "registry",
    "AlgoConfig": "config", "ClipConfig": "config", "EntropyConfig": "config", "KLConfig": "config",
    "MismatchConfig": "config", "DistillConfig": "config", "DecoupledConfig": "config",
    "ShapingConfig": "config", "TokenMaskConfig": "config", "PassKConfig": "config",
    "compute_advantages": "advantages", "grpo_advantages_reference": "advantages",
    "shape_rewards": "shaping", "token_masks": "token_mask", "distill_advantages": "distill",
    "PolicyTokens": "policy_loss",
    "filter_groups": "filtering", "filter_groups_reference": "filtering",
    "ppo_clip_loss": "policy_loss", "reinforce_loss": "policy_loss",
    "LOSS_AGG_MODES": "aggregation", "aggregate": "aggregation",
    "kl_estimate": "kl", "kl_reward_penalty": "kl",
    "mismatch_weights": "mismatch",
    "EntropyController": "entropy", "sampled_entropy_surrogate": "entropy",
    "policy_objective": "objective",
    "sgd_schedule": "schedule",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
