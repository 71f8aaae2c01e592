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

from megatron_rl.config.base import ConfigBase, ConfigError

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
    if not path.exists():
        raise ConfigError("defaults" if _seen else "config", f"file not found: {path}", str(_seen[-1]) if _seen else None)
    try:
        data = yaml.load(path.read_text(), Loader=_StrictLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"invalid YAML: {exc}", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("<file>", "the top level must be a mapping", str(path))
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged: dict = {}
    for d in defaults:
        merged = _deep_merge(merged, load_yaml_tree(path.parent / d, _seen + (path,)))
    return _deep_merge(merged, data)


def apply_override(tree: dict, item: str) -> dict:
    """Apply one ``a.b.c=value`` override (value parsed as YAML: numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(item, "overrides look like key.sub=value")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    parts = key.strip().split(".")
    node = tree
    for p in parts[:-1]:
        if p.isdigit() and isinstance(node, list):
            node = node[int(p)]
            continue
        node = node.setdefault(p, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(key, "cannot set a sub-key of a non-mapping value")
    last = parts[-1]
    if last.isdigit() and isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
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

    ``prepare`` may rewrite the merged tree before it is typed (placeholders). With ``validate``,
    an error from an overridden key names the command line instead of the file.
    """
    tree = load_yaml_tree(path) if path else {}
    for item in overrides or []:
        tree = apply_override(tree, item)
    if prepare is not None:
        tree = prepare(tree)
    cfg = cls.from_dict(tree, source=str(path) if path else None)
    if validate:
        try:
            cfg.validate()
        except ConfigError as exc:
            if exc.source is None or _from_override(exc.key, overrides or []):
                where = "the command line" if _from_override(exc.key, overrides or []) else (str(path) if path else None)
                raise ConfigError(exc.key, exc.message, where) from None
            raise
    return cfg


def _from_override(key: str, overrides: list[str]) -> bool:
    """Whether dotted ``key`` (``stages[0].x`` style) was set by one of the ``a.b=v`` overrides."""
    norm = key.replace("[", ".").replace("]", "")
    return any(norm == o.split("=", 1)[0].strip() or norm.startswith(o.split("=", 1)[0].strip() + ".")
               for o in overrides)
