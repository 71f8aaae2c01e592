"""Typed configuration base: keyword-only dataclasses that refuse unknown keys.

Every component declares its own config as a subclass of :class:`ConfigBase`, documents each field
where it is declared (a comment right above it), and checks its own values in ``validate``. Checks
that span components live in one function, :func:`megatron_rl.trainer.schema.validate_cross`.

A numeric field declares the values it accepts where it is declared (``ranged(8, ge=1)``, a
:class:`Range`); ``validate`` checks that before the component's own checks.

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


def make_dir(path, key: str, what: str = "the directory") -> None:
    """Create the directory a config key names (and its parents), or refuse naming the key: a file
    where a directory goes, no permission, a read-only file system. Before anything is built or
    started, so a run that could not write there stops with one line."""
    import os
    from pathlib import Path

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(key, f"{what} {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(key, f"cannot create {what} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, f"cannot write in {what} {path}: Permission denied")


_NONE_TYPE = type(None)


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric config field accepts: an interval whose ends are closed (``ge`` /
    ``le``), open (``gt`` / ``lt``) or absent, plus single values outside it that mean something
    (``also``: ``top_k = -1`` is off). Declared on the field with :func:`ranged`;
    :meth:`ConfigBase.validate` checks it, the config reference shows it, and the input-error tests
    probe it (every numeric field must declare one: ``ranged()`` with no bound is "any number")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple = ()

    def __post_init__(self):
        if self.ge is not None and self.gt is not None or self.le is not None and self.lt is not None:
            raise TypeError("a Range has at most one lower and one upper bound")

    @property
    def lo(self) -> float | None:
        return self.ge if self.ge is not None else self.gt

    @property
    def hi(self) -> float | None:
        return self.le if self.le is not None else self.lt

    def __contains__(self, value) -> bool:
        if value in self.also:
            return True
        below = (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
        above = (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)
        return not (below or above)

    def __str__(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        if self.lo is not None and self.hi is not None:
            text = f"{'[' if self.ge is not None else '('}{lo}, {hi}{']' if self.le is not None else ')'}"
        elif self.lo is not None:
            text = f"{'>=' if self.ge is not None else '>'} {lo}"
        elif self.hi is not None:
            text = f"{'<=' if self.le is not None else '<'} {hi}"
        else:
            return "any"
        return " or ".join([*(_number(v) for v in self.also), text])

    def refusal(self, value) -> str:
        """The error message for a value outside the range."""
        both = self.lo is not None and self.hi is not None and not self.also
        return f"must be {'in ' if both else ''}{self}, got {value!r}"


def _number(v) -> str:
    return str(v) if v is None or isinstance(v, int) else f"{v:g}"


def ranged(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, also: tuple = (), **kwargs) -> Any:
    """A numeric field and the :class:`Range` it accepts, e.g. ``group_size: int = ranged(8, ge=1)``
    (no default: a required field); ``ranged(1.0)`` declares that any number is allowed."""
    metadata = {**kwargs.pop("metadata", {}), "range": Range(ge=ge, gt=gt, le=le, lt=lt, also=also)}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def field_range(f: dataclasses.Field) -> Range | None:
    """The range declared on a field with :func:`ranged`, if any."""
    return f.metadata.get("range")


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
            elif isinstance(value, dict):
                value = {k: v.to_dict() if isinstance(v, ConfigBase) else v for k, v in value.items()}
            out[yaml_key(f)] = value
        return out

    def key(self, name: str) -> str:
        """The full dotted key of field ``name`` of this (possibly nested) config."""
        prefix = getattr(self, "_prefix", "")
        f = next((f for f in dataclasses.fields(self) if f.name == name), None)
        name = yaml_key(f) if f is not None else name
        return f"{prefix}.{name}" if prefix else name

    def differs_from_default(self, name: str) -> bool:
        """Whether field ``name`` holds another value than the one it declares (a key that only acts
        with another one set is refused when set without it)."""
        f = next(f for f in dataclasses.fields(self) if f.name == name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        return getattr(self, name) != default

    def fail(self, name: str, message: str) -> None:
        """Raise a ConfigError for field ``name`` of this config."""
        raise ConfigError(self.key(name), message)

    def check_range(self, name: str, lo: float | None = None, hi: float | None = None,
                    lo_open: bool = False) -> None:
        """A range that holds only in some settings (one that depends on another field). A field's
        own range is declared where the field is, with :func:`ranged`."""
        value = getattr(self, name)
        if value is None:
            return
        bounds = Range(**{("gt" if lo_open else "ge"): lo}, le=hi)
        if value not in bounds:
            self.fail(name, bounds.refusal(value))

    def validate(self) -> None:
        """Check this component's values: first every field's declared :class:`Range`, then the
        subclass's own checks (subclasses extend). Recurses into nested configs."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            bounds = field_range(f)
            if bounds is not None and value is not None and value not in bounds:
                self.fail(f.name, bounds.refusal(value))
            if isinstance(value, ConfigBase):
                if not hasattr(value, "_prefix"):
                    value._prefix = self.key(f.name)
                value.validate()
            elif isinstance(value, (list, dict)):
                named = value.items() if isinstance(value, dict) else enumerate(value)
                for i, v in named:
                    if isinstance(v, ConfigBase):
                        if not hasattr(v, "_prefix"):
                            sub = f".{i}" if isinstance(value, dict) else f"[{i}]"
                            v._prefix = f"{self.key(f.name)}{sub}"
                        v.validate()
