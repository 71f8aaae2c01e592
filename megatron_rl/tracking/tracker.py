"""Where metrics go: RUN_DIR/metrics.jsonl, W&B (offline by default) and the console.

Only global rank 0 tracks; other ranks get a tracker that drops everything.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path

from megatron_rl.tracking.config import TrackingConfig


def _clean(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v) if not math.isnan(float(v)) else None
        elif isinstance(v, (str, bool)) or v is None:
            out[k] = v
    return out


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: str | Path, config_dict: dict, *,
                 wandb_run_id: str | None = None, enabled: bool = True):
        self.cfg = cfg
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = None
        self._jsonl = None
        self.wandb_run_id = wandb_run_id
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        if cfg.wandb_mode != "disabled":
            self._start_wandb(config_dict)

    def _start_wandb(self, config_dict: dict) -> None:
        import wandb

        # The trainer owns its W&B service. wandb.init() writes its service's address into
        # WANDB_SERVICE, which child processes inherit: a trainer started from a process that uses
        # W&B (a notebook, a launcher, a test session) would join that process's service, and after
        # a kill -9 its run's stream would stay open there, so the resumed trainer is refused
        # ("run ID ... is in use"). A service started here dies with the trainer's job.
        os.environ.pop("WANDB_SERVICE", None)
        os.environ.setdefault("WANDB_DIR", str(self.run_dir))
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / ".wandb_cache"))
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb_run_id = self.wandb_run_id or uuid.uuid4().hex[:12]
        # resume="allow": a resumed training run continues the same W&B run (same id).
        self._wandb = wandb.init(
            project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
            name=self.cfg.wandb_name or self.run_dir.name, id=self.wandb_run_id, resume="allow",
            mode=self.cfg.wandb_mode, dir=str(self.run_dir), config=config_dict,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log(self, metrics: dict, step: int, stage: str) -> None:
        if not self.enabled:
            return
        row = {"step": step, "stage": stage, "time": time.time(), **_clean(metrics)}
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k not in ("step", "time") and v is not None},
                            step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        """A W&B table at ``step`` (e.g. a few rollout samples); nothing without W&B."""
        if self._wandb is None or not rows:
            return
        import wandb

        self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def summary(self, values: dict) -> None:
        if self._wandb is not None:
            for k, v in _clean(values).items():
                self._wandb.summary[k] = v

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
