"""Environments for multi-turn rollouts: the model acts over several turns, calling tools between them.

One file per environment, registered by name (``@register_env``), as reward styles are: the data
selects the environment of each prompt (``data.env_key``, its ``data_source``, ``envs.env_map``,
``envs.default_env``); a prompt without one is sampled single-turn, as before. Built in:
``calculator`` (arithmetic; the tool demo's) and ``python_tool`` (programs run in the code sandbox).
The config adds the user's own (``envs.classes``: subclasses of the public, versioned
:class:`Environment`, ``user.py``) and OpenEnv environment servers (``envs.services``, ``openenv.py``).
The loop that interleaves model turns with environment steps is ``megatron_rl.rollout.multi_turn``.
Imported at first use (``common.lazy``): the run schema reads ``envs.config`` alone.
"""

from megatron_rl.common.lazy import lazy_exports

_EXPORTS = {
    "EnvConfig": "config",
    "ENVIRONMENTS": "registry", "register_env": "registry",
    "Environment": "base", "StepResult": "base", "API_VERSION": "base",
    "OpenEnvServiceConfig": "config", "EnvClassError": "user", "EnvServiceError": "openenv",
    "ToolOutput": "tools", "ToolRunner": "tools",
    "TurnRenderer": "render", "TemplateError": "render",
    "Environments": "episodes", "EnvDataError": "episodes", "EnvSandboxError": "episodes",
    "episode_metrics": "metrics",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
