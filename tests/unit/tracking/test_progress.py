"""Progress of long phases (tracking/progress.py): a rich bar with an ETA on a terminal, plain lines
otherwise; install steps with pip's output in the log and only the step's own lines on the console."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
import rich
from rich.console import Console

from megatron_rl.tracking import progress
from megatron_rl.tracking.console import StageProgress
from megatron_rl.tracking.progress import Phase, duration, run_step


@pytest.fixture
def terminal(monkeypatch):
    """A terminal that records what rich draws on it."""
    screen = Console(file=io.StringIO(), force_terminal=True, width=140)
    monkeypatch.setattr(rich, "get_console", lambda: screen)
    monkeypatch.setattr(progress, "FORCE_TERMINAL", None)
    return screen


@pytest.fixture
def plain(monkeypatch):
    monkeypatch.setattr(progress, "FORCE_TERMINAL", False)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    lines: list[str] = []
    return lines


def _clock(monkeypatch, start: float = 1000.0):
    """A clock the test moves (the phases read time.monotonic)."""
    now = [start]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_duration_words():
    assert [duration(s) for s in (0.4, 42, 185, 3725)] == ["0 s", "42 s", "3 min 05 s", "1 h 02 min"]


def test_a_counted_phase_off_a_terminal_says_where_it_is_and_what_is_left(plain, monkeypatch):
    now = _clock(monkeypatch)
    with Phase("sft", total=100, unit="steps", say=plain.append) as p:
        for step in (10, 20):
            now[0] += 5.0
            p.update(step, info="val acc 0.1")
    assert plain[0] == "sft: 10/100 steps, 5 s, about 45 s left, val acc 0.1"   # 10 steps in 5 s, 90 to go
    assert plain[1] == "sft: 20/100 steps, 10 s, about 40 s left, val acc 0.1"
    assert len(plain) == 2  # (the caller says how it ended)


def test_a_cap_is_an_upper_bound_and_the_clock_caps_it_too(plain, monkeypatch):
    now = _clock(monkeypatch)
    with Phase("sft", total=1000, unit="steps", max_seconds=60, say=plain.append) as p:
        now[0] += 10.0
        p.update(10)
    assert plain[0] == "sft: 10/1000 steps, 10 s, at most 50 s left"  # the pace says 990 s, the clock 50 s


def test_timed_phases_learn_their_pace_from_the_last_one(plain, monkeypatch):
    now = _clock(monkeypatch)
    monkeypatch.setattr(progress, "_RATES", {})
    with Phase("evaluation [start]", kind="eval", work=500, say=plain.append):
        now[0] += 50.0
    with Phase("evaluation [stage1]", kind="eval", work=250, say=plain.append):
        now[0] += 20.0
    assert plain == ["evaluation [start]...", "evaluation [stage1]: about 25 s left..."]  # 0.1 s per problem


def test_on_a_terminal_a_bar_with_the_eta(terminal, monkeypatch):
    lines = []
    with Phase("stage1_12", total=4, unit="steps", say=lines.append) as p:
        assert p.on_terminal
        for step in range(1, 5):
            time.sleep(0.05)
            p.update(step, info="acc 0.500")
            terminal.file.write("")  # (rich draws on its own refresh thread)
        time.sleep(0.2)
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.file.getvalue())
    assert "stage1_12" in drawn and re.search(r"\d/4 steps", drawn) and "eta" in drawn and "acc 0.500" in drawn
    assert lines == []  # no plain lines on a terminal
    assert progress._DISPLAY.progress is None  # the display stops with its last phase


def test_nested_phases_share_one_display(terminal):
    with Phase("stage", total=3, unit="steps"):
        with Phase("evaluation [stage1_12]", estimate_s=10):
            assert len(progress._DISPLAY.progress.tasks) == 2
            time.sleep(0.3)
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.file.getvalue())
    assert "evaluation [stage1_12]" in drawn  # a label in brackets is text, not rich markup
    assert progress._DISPLAY.progress is None


def test_a_disabled_phase_shows_nothing(terminal, plain):
    with Phase("rank 1", total=3, enabled=False, say=plain.append) as p:
        p.update(3)
    assert plain == [] and progress._DISPLAY.progress is None and terminal.file.getvalue() == ""


def test_stage_lines_carry_the_eta_off_a_terminal(plain, monkeypatch, caplog):
    now = _clock(monkeypatch)
    caplog.set_level("INFO", logger="megatron_rl")
    with StageProgress("stage1_12", 10, 0) as bar:
        now[0] += 3.0
        bar.advance(1, {"rollout/accuracy": 0.5})
    assert "[stage1_12 1/10] acc=0.5 (about 27 s left)" in caplog.text


STEP = ("import sys; print('ERROR: pip\\'s dependency resolver does not currently take into account all the "
        "packages'); print('[launch/install] kept starlette==1.10.0: leptonai pins an older one'); "
        "print('WARNING: Location x is ignored', file=sys.stderr); sys.exit({code})")


@pytest.mark.parametrize("code", [0, 3])
def test_an_install_step_keeps_pip_in_the_log(plain, capsys, tmp_path, code):
    log = tmp_path / "install.log"
    got = run_step([sys.executable, "-c", STEP.format(code=code)], "[bootstrap] NeMo-Run", log, estimate_s=60,
                   before_s=30, after_s=90, show="[launch/install] ")
    shown = capsys.readouterr().out
    assert got == code
    assert not re.search(r"error|warn|deprecat", shown, re.I), shown
    assert "[launch/install] kept starlette==1.10.0" in shown
    assert "[bootstrap] NeMo-Run: about 2 min 30 s left..." in shown  # this step's 60 s and the 90 s after it
    assert ("[bootstrap] NeMo-Run: 0 s" in shown) == (code == 0)      # how long it took, when it worked
    text = log.read_text()
    assert "ERROR: pip's dependency resolver" in text and "WARNING: Location x is ignored" in text
