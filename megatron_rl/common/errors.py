"""The one base class of the errors a user can fix: what they gave cannot work.

A config value (:class:`~megatron_rl.config.base.ConfigError`), a data file
(:class:`~megatron_rl.data.dataset.DataError`), a checkpoint or run directory
(:class:`~megatron_rl.trainer.state.CheckpointError`). The message names the key, file and row;
the ``megatron-rl`` command prints it as one line (``megatron-rl: <message>``) and exits 2. Any
other exception that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class InputError(Exception):
    """Something the user supplied cannot work; the message says what and where."""
