"""The argument parser of every ``megatron-rl`` subcommand: a command line it cannot read is an
:class:`~megatron_rl.common.errors.InputError` like any other, so ``megatron-rl`` prints it as one
line on stderr (``megatron-rl: train: the following arguments are required: --config ...``) and
exits 2, instead of argparse's usage block."""

from __future__ import annotations

import argparse

from megatron_rl.common.errors import InputError

PROGRAM = "megatron-rl"


class UsageError(InputError):
    """The command line names an unknown subcommand or option, or misses a required one."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` (subparsers too)."""

    def error(self, message: str):
        sub = self.prog.removeprefix(PROGRAM).strip()
        raise UsageError(f"{sub + ': ' if sub else ''}{message} (see `{self.prog} --help`)")
