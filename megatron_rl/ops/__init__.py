"""Fused per-token log-prob and entropy (PyTorch chunked and Triton back-ends, vocab-parallel).

Importing this package needs only torch (and triton for the Triton back-end), so the ops run on a
bare GPU machine; the typed config is loaded on first access.
"""

from .logprob_entropy import fused_logprob_entropy
from .processed import processed_logprobs, top_k_top_p_mask

__all__ = ["LogprobOpsConfig", "fused_logprob_entropy", "processed_logprobs", "top_k_top_p_mask"]


def __getattr__(name):
    if name == "LogprobOpsConfig":  # megatron_rl.config pulls in YAML loading: load it lazily
        from .config import LogprobOpsConfig

        return LogprobOpsConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
