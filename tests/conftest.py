"""Shared fixtures: tiny local models (random weights, local tokenizer), built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from megatron_rl.models.tiny import TinySpec, write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), TinySpec(num_kv_heads=2, seed=7)))
