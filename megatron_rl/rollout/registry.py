"""Where launched engines say they are: one JSON file per engine in a directory the trainer reads.

Node launchers (``megatron-rl engines``, colocated or on dedicated nodes) write
``<dir>/<name>.json`` (host, port, URL, served model, weight version, pid, start time) once their
server answers ``/health``, and remove it when they stop it. The trainer waits until the engines it
expects are registered and answer, with a timeout, and names those that are missing. The directory
lives in the run directory, which every node of a job shares.

A file there that is not an engine record (not JSON, a field missing or of the wrong type, a name
other than its file's, a URL that is none) is never used: the trainer's wait stops at once with one
line naming the file, what is wrong with it and the engine it leaves missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from megatron_rl.config.base import ConfigError
from megatron_rl.rollout.addresses import url_problem
from megatron_rl.rollout.base import EngineError


class MalformedRecord(ValueError):
    """A file in the registry that is not an engine record; the message says what is wrong."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRecord:
    name: str
    url: str
    host: str
    port: int
    model: str
    # Ranks the engine takes in a weight-transfer group (vLLM TP x PP).
    workers: int = 1
    # The version of the weights the server was started with (0: the base model).
    weight_version: int = 0
    pid: int = 0
    started: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "EngineRecord":
        """The record in ``text``; :class:`MalformedRecord` says what is wrong with one that is none."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise MalformedRecord(f"not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise MalformedRecord(f"a JSON {type(data).__name__}, not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise MalformedRecord(f"unknown field(s) {unknown}")
        for name, f in fields.items():
            if name not in data:
                if f.default is dataclasses.MISSING:
                    raise MalformedRecord(f"no {name!r}")
                continue
            kind = {"str": str, "int": int, "float": (int, float)}[str(f.type)]
            value = data[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise MalformedRecord(f"{name!r} is {value!r}, not a{'n' if str(f.type) == 'int' else ''} {f.type}")
        problem = url_problem(data["url"])
        if problem:
            raise MalformedRecord(f"'url' {problem}")
        if not data["name"] or not 0 < data["port"] < 65536 or data.get("workers", 1) < 1:
            raise MalformedRecord(f"name {data['name']!r}, port {data['port']}, workers {data.get('workers', 1)}: "
                                  f"a name, a port in 1..65535 and at least one worker are needed")
        return cls(**data)


def engine_name(node: str, index: int) -> str:
    """The name of engine ``index`` of node ``node`` (what the trainer expects to find)."""
    return f"{node}-{index}"


class EngineRegistry:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.malformed: dict[Path, str] = {}

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def register(self, record: EngineRecord) -> None:
        tmp = self.dir / f".{record.name}.json.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(record.to_json())
            os.replace(tmp, self.path(record.name))  # atomic: readers never see half a record
        except OSError as exc:  # a file where the directory goes, no permission, a full disk
            raise ConfigError("rollout.registry_dir", f"cannot register engine {record.name} in {self.dir}: "
                                                      f"{exc.strerror or exc}") from None

    def unregister(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def records(self) -> dict[str, EngineRecord]:
        """The engine records; the files that are none are in :attr:`malformed` (path -> what is wrong)."""
        out, self.malformed = {}, {}
        for p in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                rec = EngineRecord.from_json(p.read_text())
            except OSError:  # removed meanwhile (writes are atomic renames: never half a record)
                continue
            except (MalformedRecord, UnicodeDecodeError) as exc:
                self.malformed[p] = str(exc)
                continue
            if rec.name != p.stem:
                self.malformed[p] = f"names engine {rec.name!r} in the file of engine {p.stem!r}"
                continue
            out[rec.name] = rec
        return out

    def _refuse_malformed(self, names: list[str] | None) -> None:
        """Stop the wait at a file that is no record of an engine waited for (it will not fix
        itself), naming the engine it leaves missing."""
        bad = {p: what for p, what in self.malformed.items() if names is None or p.stem in names}
        if not bad:
            return
        path, what = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more such files)" if len(bad) > 1 else ""
        raise ConfigError("rollout.registry_dir", f"{path}: not an engine record: {what}; engine {path.stem!r} "
                                                  f"cannot be found{more} (remove the file, or point "
                                                  f"rollout.registry_dir at the run's own)")

    def wait(self, count: int, names: list[str] | None, timeout_s: float, ready=lambda rec: True,
             poll_s: float = 0.5) -> list[EngineRecord]:
        """The ``count`` engines (exactly ``names`` when given), once each is registered and
        ``ready(record)``; raises :class:`EngineError` after ``timeout_s`` naming what is missing."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError("rollout.registry_dir", f"{self.dir} is not a directory (the engines register there)")
        deadline = time.monotonic() + timeout_s
        ok: dict[str, EngineRecord] = {}
        while True:
            recs = self.records()
            self._refuse_malformed(names)
            wanted = names if names is not None else sorted(recs)
            for name in wanted:
                rec = recs.get(name)
                if rec is None:
                    ok.pop(name, None)
                elif name not in ok or ok[name] != rec:
                    if ready(rec):
                        ok[name] = rec
            if names is not None and all(n in ok for n in names):
                return [ok[n] for n in names]
            if names is None and len(ok) >= count:
                return [ok[n] for n in sorted(ok)[:count]]
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        registered = sorted(self.records())
        if names is not None:
            missing = [n for n in names if n not in ok]
            what = f"missing: {missing}"
        else:
            what = f"{count - len(ok)} missing"
        not_ready = [n for n in registered if n not in ok]
        raise EngineError(
            f"waited {timeout_s:g}s for {count} rollout engines in {self.dir}: {len(ok)} ready "
            f"{sorted(ok)}, {what}" + (f"; registered but not answering: {not_ready}" if not_ready else "")
            + " (is each node's engine launcher running? see its log)")
