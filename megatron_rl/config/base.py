"""Typed configuration base: keyword-only dataclasses that refuse unknown keys.

Every component declares its own config as a subclass of :class:`ConfigBase`, documents each field
where it is declared (a comment right above it), and checks its own values in ``validate``. Checks
that span components live in one function, :func:`megatron_rl.trainer.schema.validate_cross`.

Errors always name the dotted key (``algo.clip.eps_high``) and, when the value came from a file, the
file, so a typo in a YAML file is an error and never a silent default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

from megatron_rl.common.errors import InputError


# ``ConfigError.source`` of a value given as a ``key=value`` override.
COMMAND_LINE = "<command line>"


class ConfigError(InputError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``key`` is the full dotted key, ``source`` the file it came from (if any), or
    :data:`COMMAND_LINE` for an override.
    """

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key = key
        self.message = message
        self.source = source
        if source == COMMAND_LINE:
            where = " on the command line"
        else:
            where = f" (in {source})" if source else ""
        super().__init__(f"config key '{key}'{where}: {message}")


_NONE_TYPE = type(None)


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line: its name, or ``metadata["key"]`` where the
    key is a Python keyword (``rollout.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str | None) -> Any:
    """Convert a YAML/CLI value to the declared type, or raise a ConfigError naming ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and _NONE_TYPE in args:
            return None
        errors = []
        for arg in args:
            if arg is _NONE_TYPE:
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as exc:  # try the next member of the union
                errors.append(str(exc))
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}", source)
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(key, f"must be one of {list(allowed)}, got {value!r}", source)
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}", source)
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}", source)
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _coerce(v, val_tp, f"{key}.{k}", source) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {value!r}", source)
        return tp.from_dict(value, prefix=key, source=source)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {value!r}", source)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(key, f"expected an integer, got {value!r}", source)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}", source)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}", source)
        return value
    return value


@dataclasses.dataclass(kw_only=True)
class ConfigBase:
    """Base class of every component config."""

    _section: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "", source: str | None = None):
        data = dict(data or {})
        hints = get_type_hints(cls)
        names = {yaml_key(f): f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(names))
        if unknown:
            key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
            raise ConfigError(key, f"unknown key; valid keys here are {sorted(names)}", source)
        kwargs = {}
        for ykey, value in data.items():
            key = f"{prefix}.{ykey}" if prefix else ykey
            kwargs[names[ykey]] = _coerce(value, hints[names[ykey]], key, source)
        try:
            obj = cls(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise ConfigError(prefix or cls.__name__, str(exc), source) from None
        obj._prefix = prefix
        return obj

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ConfigBase):
                value = value.to_dict()
            elif isinstance(value, list):
                value = [v.to_dict() if isinstance(v, ConfigBase) else v for v in value]
            out[yaml_key(f)] = value
        return out

    def key(self, name: str) -> str:
        """The full dotted key of field ``name`` of this (possibly nested) config."""
        prefix = getattr(self, "_prefix", "")
        f = next((f for f in dataclasses.fields(self) if f.name == name), None)
        name = yaml_key(f) if f is not None else name
        return f"{prefix}.{name}" if prefix else name

    def fail(self, name: str, message: str) -> None:
        """Raise a ConfigError for field ``name`` of this config."""
        raise ConfigError(self.key(name), message)

    def check_range(self, name: str, lo: float | None = None, hi: float | None = None,
                    lo_open: bool = False) -> None:
        value = getattr(self, name)
        if value is None:
            return
        if lo is not None and (value < lo or (lo_open and value == lo)):
            self.fail(name, f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
        if hi is not None and value > hi:
            self.fail(name, f"must be <= {hi}, got {value!r}")

    def validate(self) -> None:
        """Check this component's values; subclasses extend. Recurses into nested configs."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ConfigBase):
                if not hasattr(value, "_prefix"):
                    value._prefix = self.key(f.name)
                value.validate()
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    if isinstance(v, ConfigBase):
                        if not hasattr(v, "_prefix"):
                            v._prefix = f"{self.key(f.name)}[{i}]"
                        v.validate()
