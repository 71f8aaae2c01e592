"""Methods added to every vLLM worker (``worker_extension_cls``), called through ``collective_rpc``.

They run inside the worker, next to the model, so weights are loaded by vLLM's own weight loaders
(``reload_weights`` repacks them the way the engine stores them; a plain ``model.load_weights`` after
start-up fails on CPU because the weights were repacked).
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """A stable checksum of a tensor's bytes (dtype and shape included)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class WeightUpdateExtension:
    """Mixed into vLLM's worker class by vLLM itself."""

    def mrl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors in place; returns the number of tensors loaded."""
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        return len(named_tensors)

    def mrl_named_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """Checksums of the engine's own parameters (vLLM names), for tests and debugging."""
        model = self.model_runner.get_model()
        return {n: tensor_checksum(p) for n, p in model.named_parameters() if names is None or n in names}
