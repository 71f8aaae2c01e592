"""Prompt data: verl-format datasets (jsonl / json / parquet), a resumable loader, difficulty labels.

The labels are written by ``megatron_rl.tools.difficulty`` (``megatron-rl data difficulty``); the
CPU demo's addition task is ``megatron_rl.demo.synthetic``.
"""

from megatron_rl.data.config import DIFFICULTY_LABELS, DataConfig
from megatron_rl.data.dataset import DataError, PromptRecord, load_prompts, read_rows
from megatron_rl.data.loader import PromptLoader

__all__ = ["DataConfig", "DataError", "PromptRecord", "PromptLoader", "load_prompts", "read_rows",
           "DIFFICULTY_LABELS"]
