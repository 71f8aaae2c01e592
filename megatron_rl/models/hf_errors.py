"""The error a Hugging Face model directory raises when it cannot be used (its own module: the
dense and the Mixture-of-Experts readers both raise it)."""

from __future__ import annotations

from megatron_rl.common.errors import InputError


class HFModelError(InputError, ValueError):
    """A Hugging Face model directory cannot be used: its ``config.json`` is missing, unreadable or
    describes what we cannot build, or its weights cannot be read or do not fit."""
