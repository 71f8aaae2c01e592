"""Methods added to every vLLM worker (``worker_extension_cls``), called through ``collective_rpc``.

They run inside the worker, next to the model, so weights are loaded by vLLM's own weight loaders
(``reload_weights`` repacks them the way the engine stores them; a plain ``model.load_weights`` after
start-up fails on CPU because the weights were repacked). Checksums of what engines received live with
the weight sync (``megatron_rl.sync.buckets``).
"""

from __future__ import annotations

import torch


class WeightUpdateExtension:
    """Mixed into vLLM's worker class by vLLM itself."""

    def mrl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors in place; returns the number of tensors loaded."""
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        return len(named_tensors)
