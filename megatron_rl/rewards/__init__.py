"""Rewards: a registry of verifiers keyed by the data's reward style.

``exact_boxed`` (in-process), ``math`` (math-verify in a hard-timeout process pool), ``code`` (a
sandboxed program against test cases), ``llm_judge`` (an OpenAI-compatible endpoint), and the user's
own functions (``reward.functions``, ``user.py``).
"""

from megatron_rl.rewards import code as _code  # noqa: F401  (registers "code")
from megatron_rl.rewards import final_answer as _final  # noqa: F401  (registers "boxed_final")
from megatron_rl.rewards import judge as _judge  # noqa: F401  (registers "llm_judge")
from megatron_rl.rewards import math as _math  # noqa: F401  (registers "exact_boxed", "math")
from megatron_rl.rewards.base import (Outcome, RewardItem, get_style, register_reward,
                                      registered_styles)
from megatron_rl.rewards.config import (CodeConfig, JudgeConfig, MathConfig, RewardConfig,
                                        SandboxConfig)
from megatron_rl.rewards.manager import RewardDataError, RewardManager, check_reward_styles
from megatron_rl.rewards.user import RewardFunctionError

__all__ = ["RewardItem", "Outcome", "RewardConfig", "MathConfig", "CodeConfig", "JudgeConfig",
           "SandboxConfig", "RewardManager", "RewardDataError", "check_reward_styles", "register_reward", "RewardFunctionError",
           "get_style", "registered_styles"]
