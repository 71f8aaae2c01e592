"""The CPU demo's pieces: a tiny random HF model with a local tokenizer (``tiny.py``), a synthetic
verifiable task (2-3 digit addition, ``synthetic.py``), their configs (``config.py``), and writing
both into the run directory (``inputs.py``, called by the entry point). Imported at first use
(``common.lazy``): the run schema reads ``demo.config`` without importing torch / transformers."""

from megatron_rl.common.lazy import lazy_exports

_EXPORTS = {
    "SyntheticConfig": "config", "TinySpec": "config",
    "prepare_inputs": "inputs", "tiny_model_dir": "inputs",
    "Problem": "synthetic", "sample_problems": "synthetic", "write_dataset": "synthetic",
    "build_bpe_tokenizer": "tiny", "build_char_tokenizer": "tiny", "write_tiny_model": "tiny",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
