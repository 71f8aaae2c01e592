"""The environment registry: name -> :class:`~megatron_rl.envs.base.Environment` subclass.

The built-in environments are declared with the module that registers them, so a config's choice is
checked by name without importing them."""

from __future__ import annotations

from megatron_rl.common.registry import Registry

ENVIRONMENTS: Registry[type] = Registry(
    "environment", hint="a new environment is a class registered with @register_env",
    declared={"calculator": "megatron_rl.envs.calculator", "python_tool": "megatron_rl.envs.python_tool"})


def register_env(name: str):
    """Class decorator: register an :class:`~megatron_rl.envs.base.Environment` subclass as ``name``
    (a duplicate name is refused)."""

    def deco(cls):
        cls.name = name
        ENVIRONMENTS.add(name, cls)
        return cls

    return deco
