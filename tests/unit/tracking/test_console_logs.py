"""The console shows our lines and libraries' errors; libraries' INFO and warnings go to RUN_DIR/logs/."""

from __future__ import annotations

import io
import logging

import pytest

from megatron_rl.tracking.logs import (ConsoleFilter, EarlyRecords, hidden_warnings, hold_early_records, route_logs,
                                      set_console_verbose)


def _drop_console_filters() -> None:
    """pytest's own capture handlers sit on the root logger for the whole session: a filter an earlier
    test's CLI call put on them (and the library warnings it counted since) must not leak in."""
    for h in logging.getLogger().handlers:
        for f in [f for f in h.filters if isinstance(f, ConsoleFilter)]:
            h.removeFilter(f)


@pytest.fixture
def console():
    _drop_console_filters()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("vllm").handlers[:],
             logging.getLogger("vllm").propagate, logging.getLogger("vllm").level)
    tf = logging.getLogger("transformers")
    saved_tf = (tf.handlers[:], tf.propagate)
    buf = io.StringIO()
    root.handlers = [logging.StreamHandler(buf)]
    # vLLM's own set-up: a console handler on "vllm" that does not propagate.
    vllm = logging.getLogger("vllm")
    vllm.handlers = [logging.StreamHandler(buf)]
    vllm.propagate = False
    yield buf
    for h in root.handlers:
        if isinstance(h, logging.FileHandler):
            h.close()
    root.handlers, root.level = saved[0], saved[1]
    vllm.handlers, vllm.propagate, vllm.level = saved[2], saved[3], saved[4]
    tf.handlers, tf.propagate = saved_tf
    logging.captureWarnings(False)
    _drop_console_filters()


def test_library_chatter_goes_to_the_run_log(tmp_path, console):
    path = route_logs(tmp_path, verbose=False)
    route_logs(tmp_path)  # idempotent: one file handler
    assert sum(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers) == 1
    logging.getLogger("vllm.v1.worker").info("Successfully reset prefix cache")
    logging.getLogger("megatron_rl").info("[stage1 3/120] acc=0.41")
    logging.getLogger("transformers.tokenization").warning("a real warning")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecation nobody reads")
    shown = console.getvalue()
    logging.getLogger("vllm.engine").error("an engine error")
    assert "acc=0.41" in shown and "an engine error" in console.getvalue()
    assert "prefix cache" not in shown and "deprecation" not in shown and "a real warning" not in shown
    assert hidden_warnings() == 2  # the library warning and the Python warning
    text = path.read_text()
    for line in ("Successfully reset prefix cache", "acc=0.41", "a real warning", "deprecation nobody"):
        assert line in text
    assert path == tmp_path / "logs" / "run.log"


def test_verbose_brings_the_libraries_back(tmp_path, console):
    route_logs(tmp_path, verbose=True)
    logging.getLogger("vllm").info("Reloading and processing weights took 0.02 seconds")
    assert "Reloading" in console.getvalue()
    set_console_verbose(False)
    logging.getLogger("vllm").info("second chatter")
    assert "second chatter" not in console.getvalue()
    assert route_logs(tmp_path, rank=3).name == "run.rank3.log"


def test_warnings_before_the_run_dir_exists_go_to_the_run_log(tmp_path, console):
    """Megatron-Core warns at its import ("Transformer Engine and Apex are not installed"), before the
    run directory exists: held, off the console, counted, then written into run.log."""
    import warnings

    logging.getLogger().setLevel(logging.INFO)  # (the entry point's level)
    set_console_verbose(False)
    hold_early_records()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
    logging.getLogger("megatron_rl").info("our own early line")
    assert "Transformer Engine" not in console.getvalue() and "our own early line" in console.getvalue()
    path = route_logs(tmp_path)
    text = path.read_text()
    assert "Transformer Engine and Apex are not installed" in text and "our own early line" in text
    assert hidden_warnings() == 1
    assert not any(isinstance(h, EarlyRecords) for h in logging.getLogger().handlers)


def test_the_real_entry_point_keeps_the_console_clean(tmp_path):
    """``megatron-rl demo`` for real, up to the first check after the world started (a model directory
    that does not exist): Megatron-Core is imported and the process group built, then the run stops
    with its one line. No line on the console says error, deprecated or warning (Megatron's "Transformer
    Engine and Apex are not installed" fallbacks on a machine without them are in run.log); then the
    call with which vLLM's CPU worker binds its memory, which makes torch print a C++ "Warning: NUMA
    binding ...", in a process set up the same way."""
    import importlib.util
    import os
    import re
    import subprocess
    import sys

    # (scripts/test.sh ignores Python warnings; the entry point sets the C++ level itself)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL")}
    run = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "demo", "--run-dir", str(tmp_path / "run"),
                          f"model.path={tmp_path / 'no_model'}"], capture_output=True, text=True, timeout=600, env=env)
    shown = run.stdout + run.stderr
    assert run.returncode == 2 and "no Hugging Face model at" in run.stderr, shown[-3000:]
    assert not re.search(r"error|deprecat|warn", shown, re.I), shown[-3000:]
    if importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None:
        assert "Transformer Engine and Apex are not installed" in (tmp_path / "run" / "logs" / "run.log").read_text()
    numa = ("from megatron_rl.tracking.logs import quiet_native_console; quiet_native_console(); import torch\n"
            "try:\n    import vllm._C; torch.ops._C.init_cpu_memory_env([0])\n"
            "except (ImportError, AttributeError, RuntimeError): pass\nprint('bound')")
    bound = subprocess.run([sys.executable, "-c", numa], capture_output=True, text=True, timeout=600, env=env)
    assert bound.returncode == 0 and not re.search(r"warn", bound.stdout + bound.stderr, re.I), bound.stderr[-2000:]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_run_sets_the_cpp_warning_level_before_torch(monkeypatch, tmp_path, capsys, verbose):
    """``train`` / ``demo`` hold torch's C++ warnings (which the process above shows on the console)
    below ERROR from their first line, unless ``--verbose``; a level the user set stays."""
    import os

    from megatron_rl.cli import main

    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "two")  # stops the run at its first check, before anything is made
    assert main(["demo", "--run-dir", str(tmp_path / "run"), *(["--verbose"] if verbose else [])]) == 2
    assert os.environ.get("TORCH_CPP_LOG_LEVEL") == (None if verbose else "ERROR")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    main(["demo", "--run-dir", str(tmp_path / "run")])
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
    capsys.readouterr()
