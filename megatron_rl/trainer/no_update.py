"""A run that trains nothing says so: why a step made no update, and a stop after too many in a row.

A step makes no update when zero-variance filtering drops every group (all-correct, all-wrong, or
equal fractional rewards: no advantage to learn from). One such step is normal; a long streak means
the run is not training (a prompt format the model cannot answer, a reward that cannot parse its
answers), so after ``trainer.max_steps_without_update`` in a row the run stops with a diagnosis:
the streak's outcome counts (unparsable / wrong / correct / timeouts / errors) and one response.
"""

from __future__ import annotations

# (label, reward-manager metric) of the outcome counts in the diagnosis.
OUTCOMES = [("unparsable", "reward/unparsable"), ("wrong", "reward/wrong"),
            ("correct", "reward/correct"), ("timeouts", "reward/timeouts"),
            ("errors", "reward/errors")]


class NoUpdateStop(RuntimeError):
    """The run made no update for ``trainer.max_steps_without_update`` consecutive steps."""


def no_update_reason(metrics: dict) -> str:
    """Why a step made no update, from its filter metrics (``algo.filter_groups``)."""
    groups = int(metrics.get("filter/groups", 0))
    return (f"no update: all {groups} groups have zero reward variance "
            f"({int(metrics.get('filter/all_correct', 0))} all-correct, "
            f"{int(metrics.get('filter/all_wrong', 0))} all-wrong, "
            f"{int(metrics.get('filter/uniform_other', 0))} other equal rewards)")


class NoUpdateWatch:
    """Counts consecutive steps without an update and their outcomes (the driver's metrics)."""

    def __init__(self, limit: int):
        self.limit = limit  # 0: never stop
        self.streak = 0
        self.counts = {label: 0 for label, _ in OUTCOMES}
        self.sample = ""

    def record(self, updated: bool, metrics: dict, sample: str = "") -> None:
        if updated:
            self.streak = 0
            self.counts = {label: 0 for label, _ in OUTCOMES}
            return
        self.streak += 1
        for label, key in OUTCOMES:
            self.counts[label] += int(metrics.get(key, 0))
        self.sample = sample or self.sample

    @property
    def exhausted(self) -> bool:
        return bool(self.limit) and self.streak >= self.limit

    def diagnosis(self) -> str:
        counts = ", ".join(f"{label} {n}" for label, n in self.counts.items())
        return (f"{self.streak} consecutive steps without an update (trainer.max_steps_without_"
                f"update={self.limit}): every group had zero reward variance, so nothing was "
                f"trained. Outcomes over those steps: {counts}. A sample response: {self.sample}")
