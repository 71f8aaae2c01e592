"""Where launched engines say they are: one JSON file per engine in a directory the trainer reads.

Node launchers (``megatron-rl engines``, colocated or on dedicated nodes) write
``<dir>/<name>.json`` (host, port, URL, served model, weight version, pid, start time) once their
server answers ``/health``, and remove it when they stop it. The trainer waits until the engines it
expects are registered and answer, with a timeout, and names those that are missing. The directory
lives in the run directory, which every node of a job shares.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from megatron_rl.rollout.base import EngineError


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
        return cls(**json.loads(text))


def engine_name(node: str, index: int) -> str:
    """The name of engine ``index`` of node ``node`` (what the trainer expects to find)."""
    return f"{node}-{index}"


class EngineRegistry:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def register(self, record: EngineRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{record.name}.json.tmp"
        tmp.write_text(record.to_json())
        os.replace(tmp, self.path(record.name))  # atomic: readers never see half a record

    def unregister(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def records(self) -> dict[str, EngineRecord]:
        out = {}
        for p in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                rec = EngineRecord.from_json(p.read_text())
            except (OSError, ValueError, TypeError):  # being replaced, or not ours
                continue
            out[rec.name] = rec
        return out

    def wait(self, count: int, names: list[str] | None, timeout_s: float, ready=lambda rec: True,
             poll_s: float = 0.5) -> list[EngineRecord]:
        """The ``count`` engines (exactly ``names`` when given), once each is registered and
        ``ready(record)``; raises :class:`EngineError` after ``timeout_s`` naming what is missing."""
        deadline = time.monotonic() + timeout_s
        ok: dict[str, EngineRecord] = {}
        while True:
            recs = self.records()
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
