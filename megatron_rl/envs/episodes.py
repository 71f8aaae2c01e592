"""A run's environments: which one each prompt gets, and a fresh episode of it per trajectory.

Resolution, for a prompt (a :class:`~megatron_rl.data.PromptRecord`), first match wins: its ``env``
field (``data.env_key``) when it names a registered environment, its ``data_source`` when it does,
``envs.env_map[data_source]``, ``envs.env_map[env]``, ``envs.default_env``. None: the prompt is sampled
single-turn, as without environments. A prompt whose data names an environment that resolves to none
is a data error (file and row), found before anything is built.
"""

from __future__ import annotations

from megatron_rl.common.errors import InputError
from megatron_rl.envs.base import Environment
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.registry import ENVIRONMENTS
from megatron_rl.envs.render import TurnRenderer
from megatron_rl.envs.tools import ToolRunner
from megatron_rl.envs.user import check_user_envs, register_user_envs
from megatron_rl.rewards.config import SandboxConfig


class EnvDataError(InputError, ValueError):
    """A prompt names an environment that is not registered (nor mapped)."""


class EnvSandboxError(InputError):
    """Prompts need an environment whose tools run in the code sandbox, and it cannot start here."""


class Environments:
    """The environments of a run: resolution, episodes, their tools and the turn renderer."""

    def __init__(self, cfg: EnvConfig, tokenizer, *, max_turns: int, sandbox: SandboxConfig | None = None,
                 wait_s: float = 600.0):
        """``max_turns``: model turns per trajectory (``rollout.max_turns``); ``sandbox``: the limits of
        sandboxed tool programs (``reward.code.sandbox``); ``wait_s``: the bound on any wait for an
        environment (``rollout.timeout_s``)."""
        cfg.validate()
        register_user_envs(cfg)  # envs.classes (imported and checked here), envs.services
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.wait_s = wait_s
        self.tools = ToolRunner(cfg.tool_timeout_s, cfg.num_workers, sandbox, wait_s=wait_s)
        self._renderer: TurnRenderer | None = None
        self._checked: set[str] = set()  # environments whose start-up checks passed

    @property
    def renderer(self) -> TurnRenderer:
        """The chat template's tool-message tokens (checked at the first use: :meth:`check`)."""
        if self._renderer is None:
            self._renderer = TurnRenderer(self.tokenizer)
        return self._renderer

    def name(self, record) -> str | None:
        """The environment of ``record`` (None: single-turn); EnvDataError for an unknown one."""
        env, source = getattr(record, "env", "") or "", record.data_source
        for key in (env, source):
            if key and key in ENVIRONMENTS:
                return key
        for key in (source, env):
            if key and key in self.cfg.env_map:
                return self.cfg.env_map[key]
        if env:
            raise EnvDataError(f"row {record.row}: environment {env!r}: {ENVIRONMENTS.unknown_message(env)}; "
                               f"map it with envs.env_map")
        return self.cfg.default_env or None

    def check(self, records, path: str) -> dict[str, int]:
        """Resolve every prompt of ``path`` (a DataError naming file and row for an unknown
        environment) and check the chat template renders tool messages when one has an
        environment, and that the code sandbox starts when one's tools need it (else every call
        would be an error message: the run would train on nothing). Returns the prompts per
        environment."""
        counts: dict[str, int] = {}
        for r in records:
            try:
                name = self.name(r)
            except EnvDataError as exc:
                raise EnvDataError(f"{path}: {exc}") from None
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        for name in counts:
            ENVIRONMENTS[name]  # imports its module: a broken one fails now
        check_user_envs(self.cfg, set(counts) - self._checked)  # the servers prompts use answer
        self._checked.update(counts)
        sandboxed = sorted(n for n in counts if ENVIRONMENTS[n].needs_sandbox)
        if sandboxed:
            from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailable

            try:
                Sandbox(self.tools.sandbox)
            except SandboxUnavailable as exc:
                raise EnvSandboxError(f"{path}: {sum(counts[n] for n in sandboxed)} prompts use environment "
                                      f"{', '.join(sandboxed)}, whose tool runs programs in the sandbox: "
                                      f"{exc}") from None
        if counts:
            self.renderer  # noqa: B018 - a template that cannot render tool messages fails now
        return counts

    def open(self, record) -> Environment | None:
        """A fresh episode's environment for ``record`` (None: the prompt is single-turn)."""
        name = self.name(record)
        return None if name is None else ENVIRONMENTS[name](self.cfg, self.tools)

    def close(self) -> None:
        self.tools.close()
