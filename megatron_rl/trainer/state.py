"""Run-directory layout, resumable trainer state and checkpoints.

    RUN_DIR/
      run_state.json                    finished stages, SFT status, W&B run id
      base_model/                       the tiny demo model (when model.tiny is set)
      data/{train,eval}.jsonl           the synthetic task (when synthetic.enabled)
      sft/final/                        cold-start result
      <stage>/checkpoints/step_000010/  {policy/, trainer_state.json}   (resumable, newest kept)
      <stage>/final/                    {policy/, hf/, trainer_state.json} (next stage starts here)
      metrics.jsonl, summary.json, report.png

A checkpoint directory is complete only once ``trainer_state.json`` is in it (written last, then
renamed into place), so a run killed mid-save never resumes from a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    stage: str = ""
    # Steps finished in this stage (the next step to run has this index).
    step: int = 0
    # Steps finished over the whole run (W&B's step axis).
    global_step: int = 0
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
        p = self.root / "run_state.json"
        return json.loads(p.read_text()) if p.exists() else {"finished_stages": [], "sft_done": False}

    def write_run_state(self, state: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "run_state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.root / "run_state.json")

    # --- checkpoints ----------------------------------------------------------------------------
    @staticmethod
    def is_complete(ckpt: Path) -> bool:
        return (ckpt / STATE_FILE).exists()

    def latest_step_checkpoint(self, stage: str) -> Path | None:
        d = self.stage_dir(stage) / "checkpoints"
        if not d.exists():
            return None
        done = sorted(p for p in d.iterdir() if p.name.startswith("step_") and self.is_complete(p))
        return done[-1] if done else None

    def prune(self, stage: str, keep: int) -> None:
        d = self.stage_dir(stage) / "checkpoints"
        if not d.exists():
            return
        done = sorted(p for p in d.iterdir() if p.name.startswith("step_"))
        for p in done[:-keep]:
            shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def write_state(ckpt: Path, state: TrainerState) -> None:
        tmp = ckpt / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(state)))
        os.replace(tmp, ckpt / STATE_FILE)

    @staticmethod
    def read_state(ckpt: Path) -> TrainerState:
        return TrainerState(**json.loads((ckpt / STATE_FILE).read_text()))
