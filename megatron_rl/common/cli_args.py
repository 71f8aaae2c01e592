"""The one way every entry point reports what the user gave that cannot work.

Every command (``megatron-rl`` and its subcommands, ``python -m launch.run``, the helpers the
``slurm/`` scripts run) prints an :class:`~megatron_rl.common.errors.InputError` (a config value,
data file, model, checkpoint, or a command line its parser cannot read) as one line on stderr,
``megatron-rl: <message>`` (``megatron-rl: (rank N) <message>`` on ranks other than 0), and exits 2
(:func:`run_main`); any other exception is a bug and keeps its traceback. The argument parser's
errors are such errors too (:class:`ArgumentParser`), so a bad command line is that same one line
(``megatron-rl: train: the following arguments are required: --config (see ...)``) instead of
argparse's usage block.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from megatron_rl.common.errors import InputError
from megatron_rl.common.launch_env import rank_hint

PROGRAM = "megatron-rl"
# The exit status of an input error (argparse's, too).
INPUT_ERROR_EXIT_CODE = 2


class UsageError(InputError):
    """The command line names an unknown subcommand or option, or misses a required one."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` (subparsers too).
    ``command`` names the entry point in the message (default: the subcommand of ``prog``)."""

    def __init__(self, *args, command: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command

    def error(self, message: str):
        sub = self.command if self.command is not None else self.prog.removeprefix(PROGRAM).strip()
        raise UsageError(f"{sub + ': ' if sub else ''}{message} (see `{self.prog} --help`)")


def report(exc: BaseException) -> None:
    """Print ``exc`` as the one line of an input error (stderr)."""
    rank = rank_hint()  # (a RANK that is no number is itself reported here)
    print(f"{PROGRAM}: {'' if rank == 0 else f'(rank {rank}) '}{exc}", file=sys.stderr)


def run_main(fn: Callable[[], int | None]) -> int:
    """``fn()``'s exit status; an :class:`InputError` is reported (:func:`report`) with exit 2."""
    try:
        return fn() or 0
    except InputError as exc:
        report(exc)
        return INPUT_ERROR_EXIT_CODE
