"""Objects from the user's own code, named in a config as ``"pkg.module:name"`` or ``"path/file.py:name"``.

The one loader behind user reward functions (``reward.functions``) and user environments
(``envs.classes``): :func:`parse_target` checks the form (at config validation, importing nothing),
:func:`load_target` imports the module (a ``.py`` file under a name of its own, its directory appended
to ``sys.path`` so it can import its neighbours) and returns the object. Every failure is a
:class:`UserCodeError` whose message says what is wrong in one line (the caller adds the config key).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path

_LOCK = threading.Lock()


class UserCodeError(Exception):
    """The target cannot be loaded: not of the form, not importable, no such name."""


def parse_target(target: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of ``target``; UserCodeError for a malformed one."""
    where, sep, name = (target or "").rpartition(":")
    if not sep or not where or not name:
        raise UserCodeError(f"{target!r} is not of the form 'pkg.module:name' or 'path/to/file.py:name'")
    if not all(part.isidentifier() for part in name.split(".")):
        raise UserCodeError(f"{target!r}: {name!r} is not a Python name")
    if not where.endswith(".py") and not all(part.isidentifier() for part in where.split(".")):
        raise UserCodeError(f"{target!r}: {where!r} is neither a module name (pkg.module) nor a .py file")
    return where, name


def describe(target: str) -> str:
    """``target`` for messages, a file's path made absolute: ``/path/to/file.py:fn``."""
    return absolute(target)


def absolute(target: str) -> str:
    """``target`` with a relative ``.py`` path made absolute (against the current directory), so
    that processes started elsewhere find the same file."""
    where, name = parse_target(target)
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else target


def _module_of_file(path: Path):
    # one module per file (its resolved path), under a name no package uses
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"mrl_user_{path.stem}_{digest}" if path.stem.isidentifier() else f"mrl_user_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise UserCodeError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # its own helper modules beside it
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_target(target: str):
    """The object ``target`` names. UserCodeError saying why not (the module's own exception when
    importing it raised, as ``ExceptionType: message``)."""
    where, name = parse_target(target)
    with _LOCK:
        try:
            module = _module_of_file(Path(where).resolve()) if where.endswith(".py") else importlib.import_module(where)
        except UserCodeError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever importing user code raises (SystemExit too)
            raise UserCodeError(f"importing it raised {type(exc).__name__}: {exc}"[:500]) from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UserCodeError(f"it has no {name!r}")
        obj = getattr(obj, part)
    return obj
