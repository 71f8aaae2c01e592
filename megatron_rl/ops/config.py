"""Config of the fused log-prob / entropy op (the policy forward passes these to the op)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from megatron_rl.config.base import ConfigBase


@dataclasses.dataclass(kw_only=True)
class LogprobOpsConfig(ConfigBase):
    _section: ClassVar[str] = "ops"

    # "auto": Triton on CUDA (when importable), the PyTorch chunked path elsewhere.
    backend: Literal["auto", "torch", "triton"] = "auto"
    # Tokens per tile; None picks the back-end's default for the device.
    chunk_tokens: int | None = None
    # Vocabulary rows per tile; None picks the back-end's default for the device.
    chunk_vocab: int | None = None

    def validate(self) -> None:
        super().validate()
        self.check_range("chunk_tokens", lo=1)
        self.check_range("chunk_vocab", lo=1)

    def op_kwargs(self) -> dict:
        """Keyword arguments for :func:`megatron_rl.ops.fused_logprob_entropy`."""
        return {"backend": self.backend, "chunk_tokens": self.chunk_tokens,
                "chunk_vocab": self.chunk_vocab}
