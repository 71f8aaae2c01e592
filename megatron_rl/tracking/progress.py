"""Progress of the long phases a person waits for: the install, the SFT cold start, each stage, the
evaluations, the run report.

On a terminal each phase is a rich progress bar with its ETA (bars of phases inside one another share
one display; log lines print above it); off a terminal (CI, Slurm logs, a pipe) there are plain lines
instead. Every phase is one call where it runs::

    with Phase("sft", total=3000, unit="steps", max_seconds=600) as p:   # counted
        ... p.update(step, info="val acc 0.21")
    with Phase("evaluation [start]", kind="eval", work=500):                     # timed
        ...

A *counted* phase knows its total (steps); its ETA comes from its pace (``at_most``: the total is a cap,
the phase may stop earlier, so the ETA is an upper bound; ``max_seconds``: the clock ends it by then at
the latest, an upper bound too). A *timed* phase knows how long it should
take: ``estimate_s``, or ``kind`` + ``work`` (seconds per unit of work learned from the last phase of
the same kind in this process: the second evaluation knows what the first one took). Without an
estimate it shows the time elapsed.

``python -m megatron_rl.tracking.progress --label L --log FILE --estimate S [--before B --after A] -- CMD``
runs an install step: CMD's output appended to FILE, the bar (or a line) with the install's ETA
(``B`` / ``A``: estimated seconds of the steps before / after it), then one line with how long it took.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("megatron_rl")

# Off a terminal, a counted phase prints a line at most this often (the caller says how it ended).
PLAIN_EVERY_S = 30.0
# Seconds per unit of work of the last finished timed phase of each kind (this process).
_RATES: dict[str, float] = {}
# Tests set this to force plain lines (False) or bars (True); None: ask rich whether stdout is a terminal.
FORCE_TERMINAL: bool | None = None


def duration(seconds: float) -> str:
    """``'42 s'``, ``'3 min 05 s'``, ``'1 h 02 min'``."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _on_terminal() -> bool:
    if FORCE_TERMINAL is not None:
        return FORCE_TERMINAL
    try:
        from rich import get_console
    except ImportError:  # pragma: no cover (rich is a dependency; the install's first step brings it)
        return False
    return get_console().is_terminal


class _Display:
    """The one rich display every live phase shares: started with the first, stopped with the last;
    a ticker moves timed phases with the clock."""

    def __init__(self):
        self.lock = threading.RLock()
        self.progress = None
        self.timed: dict[int, tuple[float, float, float]] = {}  # task -> (start, seconds before it, estimate)
        self._stop = threading.Event()

    def add(self, label: str, total: float | None, completed: float, **fields):
        from rich.markup import escape

        with self.lock:
            if self.progress is None:
                self.progress = self._start()
            # (escaped: "evaluation [start]" is no rich markup)
            return self.progress.add_task(escape(label), total=total, completed=completed, info="", **fields)

    def time(self, task, start: float, before: float, estimate: float) -> None:
        with self.lock:
            self.timed[task] = (start, before, estimate)

    def update(self, task, **kw) -> None:
        with self.lock:
            self.progress.update(task, **kw)

    def remove(self, task) -> None:
        with self.lock:
            self.timed.pop(task, None)
            self.progress.remove_task(task)
            if not self.progress.tasks:
                self._stop.set()
                self.progress.stop()
                self.progress = None

    def _start(self):
        from rich import get_console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        class Count(ProgressColumn):
            def render(self, task):  # "12/120 steps" (a counted phase)
                if task.fields["timed"] or task.total is None:
                    return Text("")
                return Text(f"{int(task.completed)}/{int(task.total)} {task.fields['unit']}".rstrip())

        class Eta(ProgressColumn):
            def render(self, task):  # a timed phase: its estimate minus the time spent; counted: its pace
                if task.total is None:
                    return Text("")
                left = task.total - task.completed if task.fields["timed"] else task.time_remaining
                if task.fields["max_seconds"] and task.elapsed is not None:  # the clock's own bound
                    left = min(left if left is not None else float("inf"), task.fields["max_seconds"] - task.elapsed)
                return Text("eta …" if left is None else f"eta {task.fields['eta_prefix']}{duration(left)}")

        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), Count(), TimeElapsedColumn(),
                            Eta(), TextColumn("{task.fields[info]}"), console=get_console(), transient=True)
        progress.start()
        self._stop = threading.Event()
        threading.Thread(target=self._tick, args=(progress, self._stop), daemon=True,
                         name="progress-ticker").start()
        return progress

    def _tick(self, progress, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            with self.lock:
                for task, (start, before, estimate) in list(self.timed.items()):
                    progress.update(task, completed=before + min(time.monotonic() - start, 0.99 * estimate))


_DISPLAY = _Display()


class Phase:
    """One phase's progress (see the module doc). ``enabled=False``: nothing at all (other ranks);
    ``lines=False``: no plain lines (the caller logs its own per-step lines); ``end_line``: a last
    line, on a terminal too, with the time it took; ``say``: where lines go (our logger).
    ``before_s`` / ``after_s``: estimated seconds of the steps before / after a timed phase that is
    one step of a sequence (the install): its bar and ETA then cover the whole sequence."""

    def __init__(self, label: str, *, total: float | None = None, done: float = 0, unit: str = "",
                 at_most: bool = False, max_seconds: float = 0.0, estimate_s: float | None = None,
                 kind: str | None = None,
                 work: float | None = None, before_s: float = 0.0, after_s: float = 0.0,
                 enabled: bool = True, lines: bool = True, end_line: bool = False,
                 say: Callable[[str], None] | None = None):
        self.label, self.total, self.done, self.unit = label, total, done, unit
        self.at_most = at_most or bool(max_seconds)
        self.max_seconds, self.kind, self.work = max_seconds, kind, work
        if estimate_s is None and kind in _RATES and work:
            estimate_s = _RATES[kind] * work
        if estimate_s is None and total is None and max_seconds:
            estimate_s = max_seconds  # a phase only the clock ends
        self.estimate_s, self.before_s, self.after_s = estimate_s, before_s, after_s
        self.enabled, self.lines, self.end_line = enabled, lines, end_line
        self.say = say or log.info
        self._task = None
        self._t0 = self._last_line = 0.0
        self._start_done = done

    @property
    def timed(self) -> bool:
        return self.total is None

    @property
    def on_terminal(self) -> bool:
        """Whether the phase shows as a bar (else plain lines)."""
        return self._task is not None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def __enter__(self) -> Phase:
        self._t0 = self._last_line = time.monotonic()
        if not self.enabled:
            return self
        if _on_terminal():
            self._show()
        elif self.lines and self.timed:
            left = self.eta_s()
            self.say(f"{self.label}..." if left is None else f"{self.label}: {self.eta_words(left)}...")
        return self

    def _show(self) -> None:
        prefix = "≤ " if self.at_most else ""
        if not self.timed:
            self._task = _DISPLAY.add(self.label, self.total, self.done, timed=False, unit=self.unit,
                                      eta_prefix=prefix, max_seconds=self.max_seconds)
            return
        known = self.estimate_s is not None
        total = self.before_s + self.estimate_s + self.after_s if known else None
        self._task = _DISPLAY.add(self.label, total, self.before_s, timed=True, unit="", eta_prefix=prefix,
                                  max_seconds=0)
        if known:
            _DISPLAY.time(self._task, self._t0, self.before_s, self.estimate_s)

    def update(self, completed: float, info: str = "") -> None:
        """A counted phase reached ``completed`` (``info``: a short note shown beside the bar)."""
        self.done = completed
        if not self.enabled:
            return
        if self._task is not None:
            _DISPLAY.update(self._task, completed=completed, info=info.replace("[", "\\["))
        elif self.lines and time.monotonic() - self._last_line >= PLAIN_EVERY_S:
            self._last_line = time.monotonic()
            self.say(self.status(info))

    def eta_s(self) -> float | None:
        """Seconds left (an upper bound with ``at_most``), or None while unknown."""
        if self.timed:
            return None if self.estimate_s is None else max(self.estimate_s - self.elapsed, 0.0) + self.after_s
        rate = (self.done - self._start_done) / max(self.elapsed, 1e-9)
        left = None if rate <= 0 else (self.total - self.done) / rate
        if self.max_seconds:  # the clock stops it by then at the latest
            left = min(left if left is not None else float("inf"), max(self.max_seconds - self.elapsed, 0.0))
        return left

    def status(self, info: str = "") -> str:
        """The plain line: where the phase is, how long it ran, what is left."""
        where = "" if self.timed else f"{self.done:g}/{self.total:g} {self.unit}".rstrip()
        parts = [p for p in (where, duration(self.elapsed), self.eta_words(self.eta_s()), info) if p]
        return f"{self.label}: " + ", ".join(parts)

    def eta_words(self, left: float | None = None) -> str:
        """``'about 3 min 05 s left'`` (``'at most ...'`` for a cap), ``''`` while unknown."""
        left = self.eta_s() if left is None else left
        if left is None:
            return "time unknown" if self.timed else ""
        return f"{'at most' if self.at_most else 'about'} {duration(left)} left"

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.timed and self.kind and self.work and exc_type is None:
            _RATES[self.kind] = self.elapsed / self.work
        if not self.enabled:
            return
        if self._task is not None:
            _DISPLAY.remove(self._task)
            self._task = None
        if self.end_line and exc_type is None:
            self.say(f"{self.label}: {duration(self.elapsed)}")


def run_step(cmd: list[str], label: str, log_path: Path, estimate_s: float, before_s: float = 0.0,
             after_s: float = 0.0, show: str | None = None) -> int:
    """Run an install step: its output appended to ``log_path`` (lines that start with ``show``, the
    step's own messages, also on the console); on the console a timed phase whose bar and ETA cover
    the whole install, then one line with the time the step took. Returns the step's exit status."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        out.write(f"\n==== {label}: {' '.join(cmd)}\n")
        out.flush()
        with Phase(label, estimate_s=estimate_s, before_s=before_s, after_s=after_s, end_line=True,
                   say=lambda line: print(line, flush=True)) as phase:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace")
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if show and line.startswith(show):
                    print(line.rstrip("\n"), flush=True)
            code = proc.wait()
            if code:
                phase.end_line = False
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.tracking.progress",
                                description="run one install step with its output in a log file")
    p.add_argument("--label", required=True)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--estimate", type=float, required=True, help="this step's expected seconds")
    p.add_argument("--before", type=float, default=0.0, help="estimated seconds of the steps before it")
    p.add_argument("--after", type=float, default=0.0, help="estimated seconds of the steps after it")
    p.add_argument("--show", default=None, help="the step's own lines start with this: shown on the console too")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command after --")
    return run_step(cmd, args.label, args.log, args.estimate, args.before, args.after, args.show)


if __name__ == "__main__":
    sys.exit(main())
