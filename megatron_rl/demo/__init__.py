"""The CPU demo's pieces: a tiny random HF model with a local tokenizer (``tiny.py``), a synthetic
verifiable task (2-3 digit addition, ``synthetic.py``), their configs (``config.py``), and writing
both into the run directory (``inputs.py``, called by the entry point)."""

from megatron_rl.demo.config import SyntheticConfig, TinySpec
from megatron_rl.demo.inputs import prepare_inputs, tiny_model_dir
from megatron_rl.demo.synthetic import Problem, sample_problems, write_dataset
from megatron_rl.demo.tiny import build_bpe_tokenizer, build_char_tokenizer, write_tiny_model

__all__ = ["Problem", "SyntheticConfig", "TinySpec", "build_bpe_tokenizer", "build_char_tokenizer",
           "prepare_inputs", "sample_problems", "tiny_model_dir", "write_dataset", "write_tiny_model"]
