"""Config of the fused log-prob / entropy op (the policy forward passes these to the op)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from megatron_rl.config.base import ConfigBase, ranged


@dataclasses.dataclass(kw_only=True)
class LogprobOpsConfig(ConfigBase):
    _section: ClassVar[str] = "ops"

    # "auto": Triton on CUDA (when importable), the PyTorch chunked path elsewhere.
    backend: Literal["auto", "torch", "triton"] = "auto"
    # Tokens per tile; None picks the back-end's default for the device.
    chunk_tokens: int | None = ranged(None, ge=1)
    # Vocabulary rows per tile; None picks the back-end's default for the device.
    chunk_vocab: int | None = ranged(None, ge=1)

    def op_kwargs(self) -> dict:
        """Keyword arguments for :func:`megatron_rl.ops.fused_logprob_entropy`."""
        return {"backend": self.backend, "chunk_tokens": self.chunk_tokens,
                "chunk_vocab": self.chunk_vocab}
