"""Load a typed config: YAML files with ``defaults:`` inheritance, then dotted CLI overrides.

    cfg = load(SomeConfig, "my.yaml", ["a.b=0.8", "c=[1, 2]"])

A file may start with ``defaults: [base.yaml, ...]`` (paths relative to the file); later files and
the file itself override earlier ones key by key (mappings merge, everything else replaces). Generic
machinery: it knows no component; the run's own schema (``megatron_rl.trainer.schema``) calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from megatron_rl.config.base import COMMAND_LINE, ConfigBase, ConfigError

C = TypeVar("C", bound=ConfigBase)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (YAML would silently keep the last)."""


def _no_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_yaml_tree(path: str | Path, _seen: tuple = ()) -> dict:
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError("defaults", f"inheritance cycle through {path}", str(path))
    if not path.is_file():
        what = "not a file" if path.exists() else "file not found"
        raise ConfigError("defaults" if _seen else "config", f"{what}: {path}",
                          str(_seen[-1]) if _seen else None)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"invalid YAML: {exc}", str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError("<file>", f"not UTF-8 text (byte {exc.start})", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("<file>", "the top level must be a mapping", str(path))
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) and d for d in defaults):
        raise ConfigError("defaults", f"must be a list of YAML file names (relative to this file), "
                                      f"got {defaults!r}", str(path))
    merged: dict = {}
    for d in defaults:
        merged = _deep_merge(merged, load_yaml_tree(path.parent / d, _seen + (path,)))
    return _deep_merge(merged, data)


def apply_override(tree: dict, item: str) -> dict:
    """Apply one ``a.b.c=value`` override (value parsed as YAML: numbers, bools, lists, null).

    A list element is addressed by its index (``stages.0.max_steps=5``). Every mistake is a
    :class:`ConfigError` naming the key and the command line.
    """
    if "=" not in item:
        raise ConfigError(item, "an override looks like key.sub=value", COMMAND_LINE)
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or not all(parts):
        raise ConfigError(key or item, "empty key (an override looks like key.sub=value)", COMMAND_LINE)
    if not raw.strip():
        raise ConfigError(key, "empty value (write key=null for none, or key=\"\" for an empty "
                               "string)", COMMAND_LINE)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(key, f"cannot parse the value {raw!r} ({reason})", COMMAND_LINE) from None
    node: Any = tree
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the top level"
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(key, f"{where} is a list: address an entry by its index, got "
                                       f"{part!r}", COMMAND_LINE)
            index = int(part)
            if index >= len(node):
                have = f"has {len(node)} entries (0 to {len(node) - 1})" if node else "is empty"
                raise ConfigError(key, f"{where} {have}: there is no entry {index}", COMMAND_LINE)
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # absent, or an empty YAML section
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(key, f"{where} is {node!r}, not a mapping: it has no key {part!r}",
                              COMMAND_LINE)
    return tree


def substitute(value: Any, placeholder: str, replacement: str) -> Any:
    """``placeholder`` replaced by ``replacement`` in every string of a YAML tree."""
    if isinstance(value, str):
        return value.replace(placeholder, replacement)
    if isinstance(value, dict):
        return {k: substitute(v, placeholder, replacement) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, placeholder, replacement) for v in value]
    return value


def load(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None, *,
         validate: bool = True, prepare: Callable[[dict], dict] | None = None) -> C:
    """Build config class ``cls`` from ``path`` (optional) and ``a.b=value`` overrides.

    ``prepare`` may rewrite the merged tree before it is typed (placeholders). An error in a key
    that an override set names the command line instead of the file.
    """
    overrides = list(overrides or [])
    tree = load_yaml_tree(path) if path else {}
    for item in overrides:
        tree = apply_override(tree, item)
    if prepare is not None:
        tree = prepare(tree)
    source = str(path) if path else None
    try:
        cfg = cls.from_dict(tree, source=source)
        if validate:
            cfg.validate()
    except ConfigError as exc:
        if _from_override(exc.key, overrides):
            raise ConfigError(exc.key, exc.message, COMMAND_LINE) from None
        if exc.source is None and source is not None:
            raise ConfigError(exc.key, exc.message, source) from None
        raise
    return cfg


def _override_keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0].strip() for o in overrides]


def _from_override(key: str, overrides: list[str]) -> bool:
    """Whether dotted ``key`` (``stages[0].x`` style) was set by one of the ``a.b=v`` overrides:
    the key itself, one above it (``rollout={...}``) or one below it (``rollout.top_p.x=1``)."""
    norm = key.replace("[", ".").replace("]", "")
    return any(norm == k or norm.startswith(k + ".") or k.startswith(norm + ".")
               for k in _override_keys(overrides))
