"""Run-directory layout, resumable trainer state and checkpoints.

    RUN_DIR/
      run_state.json                    finished stages, SFT status, W&B run id
      base_model/                       the tiny demo model (when model.tiny is set)
      data/{train,eval}.jsonl           the synthetic task (when synthetic.enabled)
      sft/final/                        cold-start result
      <stage>/checkpoints/step_000010/  {policy/, trainer_state.json}   (resumable, newest kept)
      <stage>/final/                    {policy/, hf/, trainer_state.json} (next stage starts here)
      metrics.jsonl, summary.json, rollouts/, logs/, report/index.html

Saves are atomic: a checkpoint is written into a hidden staging directory next to it
(``.step_000010.partial``), ``manifest.json`` (every file's size and XXH3-64 digest: the policy's
shards, the rollouts generated ahead, the HF export, the wrong-label monitor's state) and
``trainer_state.json`` last, and
only then renamed to its name; a directory is deleted by renaming it to a hidden ``.trash-`` name
first. So a kill at any moment of a save leaves either the old checkpoint or the new one under the
name, never part of one; :meth:`RunDir.recover` (at start-up) finishes or clears what a kill left.
A checkpoint damaged later (a truncated shard, a flipped byte, an edited JSON file) is found by
:func:`checkpoint_damage` before anything is loaded from it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from megatron_rl.common.errors import InputError

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
RUN_STATE_FILE = "run_state.json"
_PARTIAL = ".partial"
_TRASH = ".trash-"

log = logging.getLogger("megatron_rl")


class CheckpointError(InputError):
    """A checkpoint or the run directory's state cannot be used; the message names the file."""


@dataclass
class TrainerState:
    stage: str = ""
    # Steps finished in this stage (the next step to run has this index).
    step: int = 0
    # Steps finished over the whole run (W&B's step axis).
    global_step: int = 0
    # GRPO steps finished over all stages (SFT steps not counted): the run report's x axis.
    grpo_step: int = 0
    # Version of the weights the engines hold (bumped by every sync).
    weight_version: int = 0
    data_loader: dict = field(default_factory=dict)
    entropy_controller: dict = field(default_factory=dict)
    # Wall-clock seconds spent in GRPO steps over the whole run.
    grpo_seconds: float = 0.0
    best_eval_accuracy: float = -1.0
    evals_without_improvement: int = 0
    rng: dict = field(default_factory=dict)


def capture_rng() -> dict:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(state: dict) -> None:
    if not state:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # --- layout -------------------------------------------------------------------------------
    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def final_dir(self, stage: str) -> Path:
        return self.stage_dir(stage) / "final"

    def step_dir(self, stage: str, step: int) -> Path:
        return self.stage_dir(stage) / "checkpoints" / f"step_{step:06d}"

    # --- run state ------------------------------------------------------------------------------
    def read_run_state(self) -> dict:
        p = self.root / RUN_STATE_FILE
        if not p.exists():
            return {"finished_stages": [], "sft_done": False}
        try:
            state = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"{p}: damaged, not valid JSON ({exc}); restore it, or delete it to "
                                  f"forget which stages finished (they then run again)") from None
        if not isinstance(state, dict) or not isinstance(state.get("finished_stages", []), list):
            raise CheckpointError(f"{p}: damaged, expected an object with a 'finished_stages' list")
        state.setdefault("finished_stages", [])
        state.setdefault("sft_done", False)
        return state

    def write_run_state(self, state: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(self.root / RUN_STATE_FILE, state, indent=1)

    # --- checkpoints ----------------------------------------------------------------------------
    @staticmethod
    def is_complete(ckpt: Path) -> bool:
        return (ckpt / STATE_FILE).exists()

    def step_checkpoints(self, stage: str) -> list[Path]:
        """The stage's complete step checkpoints, newest first."""
        d = self.stage_dir(stage) / "checkpoints"
        if not d.exists():
            return []
        return sorted((p for p in d.iterdir() if p.name.startswith("step_") and self.is_complete(p)),
                      reverse=True)

    def latest_step_checkpoint(self, stage: str) -> Path | None:
        """The stage's newest intact step checkpoint (the one a resume takes)."""
        return next((p for p in self.step_checkpoints(stage) if checkpoint_damage(p) is None), None)

    def prune(self, stage: str, keep: int) -> None:
        d = self.stage_dir(stage) / "checkpoints"
        if not d.exists():
            return
        done = sorted(p for p in d.iterdir() if p.name.startswith("step_"))
        for p in done[:-keep]:
            remove_dir(p)

    def recover(self) -> None:
        """Finish or clear what a killed save left (driver only, before anything reads the run dir):
        a staging directory whose save got as far as ``trainer_state.json`` (killed before or
        during its commit) becomes the checkpoint; other staging and trash directories go."""
        if not self.root.is_dir():
            return
        parents = [d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        parents += [d / "checkpoints" for d in parents if (d / "checkpoints").is_dir()]
        for parent in parents:
            for p in parent.iterdir():
                if not p.name.startswith("."):
                    continue
                if p.name.endswith(_PARTIAL):
                    target = parent / p.name[1: -len(_PARTIAL)]
                    if self.is_complete(p) and checkpoint_damage(p) is None:
                        commit(p, target)
                        log.warning("completed the interrupted save of %s", target)
                    else:
                        remove_dir(p)
                elif _TRASH in p.name:
                    shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def write_state(ckpt: Path, state: TrainerState) -> None:
        _write_json_atomic(ckpt / STATE_FILE, asdict(state))

    @staticmethod
    def read_state(ckpt: Path) -> TrainerState:
        p = ckpt / STATE_FILE
        try:
            return TrainerState(**json.loads(p.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise CheckpointError(f"{ckpt}: not a complete checkpoint (no {STATE_FILE})") from None
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{p}: damaged ({exc})") from None


def _write_json_atomic(path: Path, obj, indent: int | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    os.replace(tmp, path)


def staging_dir(ckpt: Path) -> Path:
    """Where ``ckpt`` is written before it is renamed into place (hidden, next to it)."""
    return ckpt.parent / f".{ckpt.name}{_PARTIAL}"


def _trash_name(path: Path) -> Path:
    return path.parent / f".{path.name}{_TRASH}{os.getpid()}-{time.time_ns()}"


def remove_dir(path: Path) -> None:
    """Delete a directory so that no kill leaves part of it under its name: rename, then delete."""
    if not path.exists():
        return
    trash = _trash_name(path)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_manifest(ckpt: Path) -> None:
    """Record the size and digest of every file of a written checkpoint, in every subdirectory
    (checked by :func:`checkpoint_damage`); the trainer state, written after it, is checked by
    parsing."""
    files = {str(f.relative_to(ckpt)): {"size": f.stat().st_size, "xxh3_64": file_digest(f)}
             for f in sorted(ckpt.rglob("*")) if f.is_file() and f.relative_to(ckpt).as_posix()
             not in (MANIFEST_FILE, STATE_FILE)}
    _write_json_atomic(ckpt / MANIFEST_FILE, files)


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    """XXH3-64 of a file's bytes (hex), read in chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def commit(staging: Path, ckpt: Path) -> None:
    """Rename a fully written staging directory to ``ckpt``, replacing an older one (renamed away
    first, deleted last: between the two renames :meth:`RunDir.recover` finishes the commit)."""
    old = _trash_name(ckpt) if ckpt.exists() else None
    if old is not None:
        os.rename(ckpt, old)
    os.rename(staging, ckpt)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_damage(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (naming the file), or None when it is intact: the trainer
    state must parse, and every file the manifest lists must be there with its recorded size."""
    try:
        RunDir.read_state(ckpt)
    except CheckpointError as exc:
        return str(exc)
    manifest = ckpt / MANIFEST_FILE
    if not manifest.exists():  # written before manifests existed
        return None
    try:
        sizes = json.loads(manifest.read_text(encoding="utf-8"))
        if not isinstance(sizes, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{manifest}: damaged ({exc})"
    for rel, entry in sizes.items():
        f = ckpt / rel
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("xxh3_64"))
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, {size} when it was written (truncated or overwritten)"
        if digest is not None and file_digest(f) != digest:
            return f"{f}: its contents changed since it was written (digest differs; same size)"
    return None
