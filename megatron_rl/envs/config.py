"""Environments configuration (section ``envs``): which environment each prompt gets, and the
limits of its tools. The number of model turns is ``rollout.max_turns``."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ranged
from megatron_rl.envs.registry import ENVIRONMENTS


@dataclass(kw_only=True)
class EnvConfig(ConfigBase):
    # Map a data source (or an environment name the data gives, data.env_key) to a registered
    # environment, e.g. {"synthetic/multiplication": calculator}. Looked up after the data's own
    # choice: its env field when registered, then its data_source when that names an environment.
    env_map: dict[str, str] = field(default_factory=dict)
    # The environment of a prompt whose data names none ("": none, the prompt is sampled single-turn).
    default_env: str = ""
    # Tool calls one trajectory may make; a call beyond it is not run: the model is told the budget
    # is spent (counted in env/tool_budget_exhausted) and the episode goes on (rollout.max_turns
    # still bounds it).
    max_tool_calls: int = ranged(4, ge=0)
    # Wall-clock seconds one tool call may run: past it the call is stopped (python_tool: the
    # sandbox kills the program) and the model is told it timed out (env/tool_timeouts). The
    # sandboxed program also counts against reward.code.sandbox's limits (CPU, memory, processes,
    # file size, disk, output bytes).
    tool_timeout_s: float = ranged(5.0, gt=0.0)
    # Characters of a tool's output (stdout, and stderr when it failed) returned to the model; the
    # rest is cut and the cut is said (env/observations_cut).
    max_observation_chars: int = ranged(1024, ge=16)
    # Processes that run sandboxed tool programs (python_tool), started at the first such call.
    num_workers: int = ranged(2, ge=1)

    def validate(self) -> None:
        super().validate()
        for source, name in self.env_map.items():
            if name not in ENVIRONMENTS:
                self.fail("env_map", f"{source!r} maps to {ENVIRONMENTS.unknown_message(name)}")
        if self.default_env and self.default_env not in ENVIRONMENTS:
            self.fail("default_env", ENVIRONMENTS.unknown_message(self.default_env))

    @property
    def configured(self) -> bool:
        """Whether the config itself gives some prompts an environment (the data may too)."""
        return bool(self.env_map or self.default_env)
