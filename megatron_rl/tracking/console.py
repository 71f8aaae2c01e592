"""Console output: a progress bar per stage (on a terminal) and one summary line per step.

The bar and the log lines share rich's console, so log lines print above the bar. Off a terminal
(CI, Slurm logs) there is no bar, only the lines.
"""

from __future__ import annotations

import logging

log = logging.getLogger("megatron_rl")

# (short name, metric) pairs of the per-step line.
STEP_LINE = [("acc", "rollout/accuracy"), ("acc_nt", "rollout/accuracy_non_truncated"),
             ("trunc", "rollout/truncation_ratio"), ("len", "rollout/response_length_mean"),
             ("H", "actor/entropy"), ("α", "actor/entropy_coef"), ("gnorm", "grad_norm"),
             ("eval", "eval/accuracy"), ("suspect", "data/suspected_wrong_labels"), ("s", "timing/step")]


def step_line(metrics: dict) -> str:
    return " ".join(f"{short}={metrics[k]:.3g}" for short, k in STEP_LINE if metrics.get(k) is not None)


class StageProgress:
    """``with StageProgress(name, total, done) as p: ... p.advance(metrics)``."""

    def __init__(self, name: str, total: int, done: int = 0, enabled: bool = True):
        self.name, self.total, self.done = name, total, done
        self._progress = None
        self._task = None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                console = Console()
                if console.is_terminal:
                    self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                              MofNCompleteColumn(), TimeRemainingColumn(),
                                              TextColumn("{task.fields[acc]}"), console=console, transient=True)
            except ImportError:  # pragma: no cover
                self._progress = None

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task(self.name, total=self.total, completed=self.done, acc="")
        return self

    def advance(self, step: int, metrics: dict, note: str = "") -> None:
        """Log the step's line; ``note`` (e.g. why there was no update) ends it."""
        line = " ".join(part for part in (step_line(metrics), note) if part)
        log.info("[%s %d/%d] %s", self.name, step, self.total, line)
        if self._progress is not None:
            acc = metrics.get("rollout/accuracy")
            self._progress.update(self._task, completed=step, acc="" if acc is None else f"acc {acc:.3f}")

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
