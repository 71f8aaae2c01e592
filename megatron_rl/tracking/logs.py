"""Where log lines go: ours on the console, every library's chatter in ``RUN_DIR/logs/``.

The console is for people: our progress and one summary line per step, and any library's error.
vLLM's, transformers', Megatron's and the others' INFO lines ("Reloading and processing weights
took 0.02 seconds", "Successfully reset prefix cache"), their warnings (counted: the run says how
many at its end) and Python warnings go only to ``RUN_DIR/logs/run.log`` (every record, ours too;
``run.rank<r>.log`` on other ranks). ``tracking.console_libraries`` (``--verbose`` on the command
line) brings them back to the console. Output a library writes straight to the terminal (vLLM's
weight-loading bar, C++ warnings) is not a log record and stays.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

OURS = "megatron_rl"
# Loggers that install their own console handlers; their records are routed through the root.
SELF_CONFIGURED = ("vllm", "transformers")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def quiet_vllm_console() -> None:
    """Before vLLM is imported: ask it not to install its own console handler."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


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


def _console_handlers(root: logging.Logger) -> list[logging.Handler]:
    return [h for h in root.handlers if not isinstance(h, logging.FileHandler)]


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
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve()
               for h in root.handlers):
        fh = logging.FileHandler(path, encoding="utf-8")
        fh.setFormatter(logging.Formatter(FORMAT))
        fh.setLevel(logging.INFO)
        root.addHandler(fh)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    for name in SELF_CONFIGURED:
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lib.removeHandler(h)
        lib.propagate = True
    logging.getLogger("vllm").setLevel(logging.INFO)  # its INFO lines into the file, off the screen
    logging.captureWarnings(True)
    if not verbose:
        try:  # transformers' own progress bars ("Writing model shards") are not log records
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
    set_console_verbose(verbose)
    return path
