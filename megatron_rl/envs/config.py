"""Environments configuration (section ``envs``): which environment each prompt gets, and the
limits of its tools. The number of model turns is ``rollout.max_turns``."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ConfigError, ranged
from megatron_rl.envs.registry import ENVIRONMENTS


@dataclass(kw_only=True)
class OpenEnvServiceConfig(ConfigBase):
    """An environment served by an OpenEnv environment server (``openenv-core``), driven over its
    WebSocket session protocol (``envs/openenv.py``; docs/custom_task.md)."""

    # The server's base URL, e.g. http://127.0.0.1:8000 (its sessions are at ws://.../ws).
    url: str = ""
    # The field of the server's Action that gets the model's turn (its text), e.g. "message".
    action_field: str = "message"
    # The field of the server's Observation the model reads ("": all its fields but done, reward and
    # metadata, as JSON).
    observation_field: str = ""
    # Seconds to connect, and to wait for each answer of the server; past it the call failed.
    timeout_s: float = ranged(30.0, gt=0.0)
    # Tries after a failed call (the server restarted, a dropped connection): reconnect, reset the
    # episode with its seed, replay its actions (the observations must be the same: else the episode
    # fails), then the call again. Past them the episode ends, counted in env/tool_errors.
    retries: int = ranged(2, ge=0)

    def validate(self) -> None:
        super().validate()
        if not self.url.startswith(("http://", "https://")):
            self.fail("url", f"must be the server's http:// or https:// base URL, got {self.url!r}")
        if not self.action_field:
            self.fail("action_field", "must name the Action field that gets the model's turn")


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
    # Environments from the user's own code: {NAME: "pkg.module:Class" | "path/to/file.py:Class"}, each a
    # subclass of megatron_rl.envs.Environment (the public interface, envs/base.py, API_VERSION);
    # checked at start-up (importable, a subclass, step implemented, the API version).
    classes: dict[str, str] = field(default_factory=dict)
    # Environments served by OpenEnv environment servers: {NAME: {url: ..., action_field: ...}}.
    services: dict[str, OpenEnvServiceConfig] = field(default_factory=dict)

    def validate(self) -> None:
        super().validate()
        from megatron_rl.common.user_code import UserCodeError, parse_target

        for name, target in self.classes.items():
            try:
                parse_target(target)
            except UserCodeError as exc:
                raise ConfigError(f"{self.key('classes')}.{name}", str(exc)) from None
        for name in [*self.classes, *self.services]:
            if ENVIRONMENTS.is_declared(name):
                key = "classes" if name in self.classes else "services"
                self.fail(key, f"{name!r} is a built-in environment's name; choose another")
        for name in set(self.classes) & set(self.services):
            self.fail("services", f"{name!r} is also in envs.classes: one name, one environment")
        known = {*self.classes, *self.services}
        for source, name in self.env_map.items():
            if name not in ENVIRONMENTS and name not in known:
                self.fail("env_map", f"{source!r} maps to {self._unknown(name)}")
        if self.default_env and self.default_env not in ENVIRONMENTS and self.default_env not in known:
            self.fail("default_env", self._unknown(self.default_env))

    def _unknown(self, name: str) -> str:
        extra = f"; or one of envs.classes / envs.services {sorted({*self.classes, *self.services})}" \
            if self.classes or self.services else "; or one of envs.classes / envs.services"
        return ENVIRONMENTS.unknown_message(name) + extra

    @property
    def configured(self) -> bool:
        """Whether the config itself gives some prompts an environment (the data may too)."""
        return bool(self.env_map or self.default_env)
