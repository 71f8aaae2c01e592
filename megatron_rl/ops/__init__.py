"""Fused per-token log-prob and entropy (PyTorch chunked and Triton back-ends, vocab-parallel)."""

from .config import LogprobOpsConfig
from .logprob_entropy import fused_logprob_entropy
from .processed import processed_logprobs, top_k_top_p_mask

__all__ = ["LogprobOpsConfig", "fused_logprob_entropy", "processed_logprobs", "top_k_top_p_mask"]
