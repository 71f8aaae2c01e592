"""Console output: a progress bar per stage (on a terminal) and one summary line per step.

The bar and the log lines share rich's console, so log lines print above the bar. Off a terminal
(CI, Slurm logs) there is no bar, only the lines (with the stage's ETA).
"""

from __future__ import annotations

import logging

from megatron_rl.tracking.progress import Phase

log = logging.getLogger("megatron_rl")

# (short name, metric) pairs of the per-step line.
STEP_LINE = [("acc", "rollout/accuracy"), ("acc_nt", "rollout/accuracy_non_truncated"),
             ("trunc", "rollout/truncation_ratio"), ("len", "rollout/response_length_mean"),
             ("H", "actor/entropy"), ("α", "actor/entropy_coef"), ("gnorm", "grad_norm"),
             ("eval", "eval/accuracy"), ("suspect", "data/suspected_wrong_labels"), ("s", "timing/step")]


def step_line(metrics: dict) -> str:
    return " ".join(f"{short}={metrics[k]:.3g}" for short, k in STEP_LINE if metrics.get(k) is not None)


class StageProgress:
    """``with StageProgress(name, total, done) as p: ... p.advance(step, metrics)``: a stage's bar with
    its ETA on a terminal (``tracking/progress.py``), and one line per step (with the ETA off a terminal)."""

    def __init__(self, name: str, total: int, done: int = 0, enabled: bool = True):
        self.name, self.total, self.done = name, total, done
        self._phase = Phase(name, total=total, done=done, unit="steps", enabled=enabled, lines=False)

    def __enter__(self):
        self._phase.__enter__()
        return self

    def advance(self, step: int, metrics: dict, note: str = "") -> None:
        """Log the step's line; ``note`` (e.g. why there was no update) ends it."""
        acc = metrics.get("rollout/accuracy")
        self._phase.update(step, info="" if acc is None else f"acc {acc:.3f}")
        eta = "" if self._phase.on_terminal or step >= self.total else self._phase.eta_words()
        line = " ".join(part for part in (step_line(metrics), note, f"({eta})" if eta else "") if part)
        log.info("[%s %d/%d] %s", self.name, step, self.total, line)

    def __exit__(self, *exc):
        self._phase.__exit__(*exc)
