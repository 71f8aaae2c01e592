"""Environments the config brings: classes from the user's code (``envs.classes``) and OpenEnv servers
(``envs.services``), registered under their names beside the built-in ones.

A class is imported in the trainer's process (environments step there, on worker threads, as the
built-in ones do) and checked before anything is built: a class, a subclass of
:class:`~megatron_rl.envs.base.Environment`, ``step`` implemented, constructible as ``Class(cfg,
tools)``, written for this :data:`~megatron_rl.envs.base.API_VERSION`. A failure is one line naming
the key, the file and what is wrong (:class:`EnvClassError`).
"""

from __future__ import annotations

import inspect

from megatron_rl.common.errors import InputError
from megatron_rl.common.user_code import UserCodeError, describe, load_target
from megatron_rl.envs.base import API_VERSION, Environment
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.registry import ENVIRONMENTS


class EnvClassError(InputError, ValueError):
    """A class of envs.classes cannot serve as an environment."""


def class_problem(cls) -> str:
    """Why ``cls`` cannot be an environment ("" if it can)."""
    if not inspect.isclass(cls):
        return f"it is a {type(cls).__name__}, not a class"
    if not issubclass(cls, Environment):
        return f"{cls.__name__} is not a subclass of megatron_rl.envs.Environment"
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        return f"{cls.__name__} does not implement {', '.join(missing)}"
    if getattr(cls, "api_version", None) != API_VERSION:
        return (f"{cls.__name__} is written for environment API version {getattr(cls, 'api_version', None)!r}; "
                f"this trainer's is {API_VERSION} (docs/custom_task.md)")
    try:
        inspect.signature(cls).bind(None, None)
    except TypeError as exc:
        return f"{cls.__name__}(cfg, tools) cannot be constructed as the trainer does: {exc}"
    except ValueError:
        pass
    return ""


def register_user_envs(cfg: EnvConfig) -> None:
    """Register ``cfg.classes`` (imported and checked here) and ``cfg.services``."""
    from megatron_rl.envs.openenv import service_class

    for name, target in cfg.classes.items():
        key = f"envs.classes.{name}"
        try:
            cls = load_target(target)
        except UserCodeError as exc:
            raise EnvClassError(f"{key}: {describe(target)}: {exc}") from None
        problem = class_problem(cls)
        if problem:
            raise EnvClassError(f"{key}: {describe(target)}: {problem}")
        _add(key, name, cls)
    for name, service in cfg.services.items():
        _add(f"envs.services.{name}", name, service_class(name, service))


def _add(key: str, name: str, cls: type) -> None:
    try:
        ENVIRONMENTS.add(name, cls)
    except ValueError as exc:
        raise EnvClassError(f"{key}: {exc}; choose another name") from None
    if not cls.name:
        cls.name = name  # what its tool calls are called


def check_user_envs(cfg: EnvConfig, used: set[str]) -> None:
    """Start-up: every service some prompt uses answers (``check_service``)."""
    from megatron_rl.envs.openenv import check_service

    for name, service in cfg.services.items():
        if name in used:
            check_service(name, service)
