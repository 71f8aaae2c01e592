"""Shared by the in-process (single-rank) policy tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def groups():
    """A one-rank gloo world with Megatron's groups, torn down after the module."""
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed

    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    g = init_distributed(ParallelConfig())
    yield g
    destroy_distributed()
