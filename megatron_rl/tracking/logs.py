"""Where log lines go: ours on the console, every library's chatter in ``RUN_DIR/logs/``.

The console is for people: our progress and one summary line per step, and any library's error.
vLLM's, transformers', Megatron's and the others' INFO lines ("Reloading and processing weights
took 0.02 seconds", "Successfully reset prefix cache"), their warnings (counted: the run says how
many at its end) and Python warnings (also those at import, before the run directory exists:
:func:`hold_early_records`) go only to ``RUN_DIR/logs/run.log`` (every record, ours too;
``run.rank<r>.log`` on other ranks). ``tracking.console_libraries`` (``--verbose`` on the command
line) brings them back to the console. Output a library writes straight to the terminal (vLLM's
weight-loading bar) is not a log record and stays; torch's C++ warnings are held back below ERROR
(:func:`quiet_native_console`, not with ``--verbose``).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

OURS = "megatron_rl"
# Loggers that install their own console handlers; their records are routed through the root.
SELF_CONFIGURED = ("vllm", "transformers")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def quiet_vllm_console() -> None:
    """Before vLLM is imported: ask it not to install its own console handler."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def quiet_native_console(verbose: bool = False) -> None:
    """Before torch is imported: its C++ warnings (``[W... utils.cpp:68] Warning: NUMA binding: Using
    MEMBIND policy ...``, which vLLM's CPU worker triggers each start) are no log records and would
    reach the terminal; from ERROR up only (``TORCH_CPP_LOG_LEVEL``), unless ``verbose`` or set already."""
    if not verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class ConsoleFilter(logging.Filter):
    """Ours at every level; a library's record only from ERROR up (everything with ``verbose``).
    ``hidden_warnings`` counts the libraries' warnings kept off the console."""

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = verbose
        self.hidden_warnings = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.name == OURS or record.name.startswith(OURS + "."):
            return True
        if record.levelno >= logging.ERROR and record.name != "py.warnings":
            return True
        self.hidden_warnings += record.levelno >= logging.WARNING
        return False


class EarlyRecords(logging.handlers.MemoryHandler):
    """Holds the records logged before the run directory exists (Megatron-Core's "Transformer Engine
    and Apex are not installed" warnings come at its import, before the world starts); :func:`route_logs`
    writes them into ``run.log``. Never flushes by itself; a run that stops earlier drops them."""

    def __init__(self):
        super().__init__(capacity=10_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
        self.setLevel(logging.INFO)

    def shouldFlush(self, record: logging.LogRecord) -> bool:
        if len(self.buffer) >= self.capacity:
            self.buffer.pop(0)  # the oldest go first: a bounded buffer, never a flush to nowhere
        return False


def _capture_warnings() -> None:
    """Python warnings become log records (``py.warnings``), also when something replaced
    ``warnings.showwarning`` since the last capture (``captureWarnings(True)`` alone is then a no-op)."""
    logging.captureWarnings(False)
    logging.captureWarnings(True)


def hold_early_records() -> None:
    """Before anything imports the libraries: Python warnings become log records (off the console,
    counted) and every record is held until :func:`route_logs` has the file to write them to."""
    _capture_warnings()
    root = logging.getLogger()
    if not any(isinstance(h, EarlyRecords) for h in root.handlers):
        root.addHandler(EarlyRecords())


def _release_early_records(root: logging.Logger, file_handler: logging.Handler) -> None:
    for h in [h for h in root.handlers if isinstance(h, EarlyRecords)]:
        h.acquire()
        try:
            for record in h.buffer:
                if record.levelno >= file_handler.level:
                    file_handler.handle(record)
            h.buffer.clear()
        finally:
            h.release()
        root.removeHandler(h)


def _console_handlers(root: logging.Logger) -> list[logging.Handler]:
    return [h for h in root.handlers if not isinstance(h, (logging.FileHandler, EarlyRecords))]


def hidden_warnings() -> int:
    """Libraries' warnings kept off the console so far (they are in RUN_DIR/logs/run.log)."""
    return max((f.hidden_warnings for h in _console_handlers(logging.getLogger()) for f in h.filters
                if isinstance(f, ConsoleFilter)), default=0)


def set_console_verbose(verbose: bool) -> None:
    """Install (or update) the console filter on the root logger's console handlers."""
    for h in _console_handlers(logging.getLogger()):
        for f in h.filters:
            if isinstance(f, ConsoleFilter):
                f.verbose = verbose
                break
        else:
            h.addFilter(ConsoleFilter(verbose))


def route_logs(run_dir: str | Path, *, verbose: bool = False, rank: int = 0) -> Path:
    """Send every record to ``RUN_DIR/logs/run[.rank<r>].log``, libraries' INFO off the console.

    Idempotent: calling it again (after an engine re-configured its logging) re-routes.
    """
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / ("run.log" if rank == 0 else f"run.rank{rank}.log")
    root = logging.getLogger()
    fh = next((h for h in root.handlers
               if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve()), None)
    if fh is None:
        fh = logging.FileHandler(path, encoding="utf-8")
        fh.setFormatter(logging.Formatter(FORMAT))
        fh.setLevel(logging.INFO)
        root.addHandler(fh)
    _release_early_records(root, fh)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    for name in SELF_CONFIGURED:
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lib.removeHandler(h)
        lib.propagate = True
    logging.getLogger("vllm").setLevel(logging.INFO)  # its INFO lines into the file, off the screen
    _capture_warnings()
    if not verbose:
        try:  # transformers' own progress bars ("Writing model shards") are not log records
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
    set_console_verbose(verbose)
    return path
