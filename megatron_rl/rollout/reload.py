"""What every in-place weight load must do after vLLM's layerwise reload, whichever path loads
(the in-process engine's ``reload_weights``, the weight-transfer backends inside a server's workers).

vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``) processes each layer that
receives tensors. A tied output layer (``tie_word_embeddings``) has no tensor of its own in a
checkpoint, so the reload processes the embedding (which receives the tensor, filling the shared
storage) and puts the output layer's kernel state back untouched. On CPU that state is a copy of the
weight packed at start-up for the GEMM (``UnquantizedEmbeddingMethod.process_weights_after_loading``
builds a oneDNN / sgl handle): without :func:`refresh_tied_layers` the engine samples from the new
body and the base model's output layer.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import torch


def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Re-run vLLM's post-load processing of every layer that shares its weight with another, so its
    packed kernel state is rebuilt from the shared (reloaded) weight; on GPUs it is a no-op. Returns
    how many layers it refreshed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            # Only the unquantized embedding method repacks idempotently from the weight (vLLM's
            # own re-tying, model_loader/weight_tying.py, draws the same line).
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def reload_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """In a vLLM worker (called through ``collective_rpc``): vLLM's in-place reload of HF-named
    tensors, then :func:`refresh_tied_layers`. Returns how many layers were refreshed."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    return refresh_tied_layers(worker.model_runner.get_model())


def serialise(weights: list[tuple[str, torch.Tensor]]) -> bytes:
    """HF-named tensors as one blob for an engine core in another process (vLLM's own channel turns
    tensors in a ``collective_rpc`` into lists). Tensors may share storage (views of one bucket)."""
    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu()) for name, t in weights], buf)
    return buf.getvalue()


class ReloadWorkerExtension:
    """Mixed into the workers of an engine whose core runs in its own process
    (``worker_extension_cls``): :func:`reload_in_place` of a :func:`serialise` blob, by name."""

    def mrl_reload(self, blob: bytes) -> int:
        weights = torch.load(io.BytesIO(blob), weights_only=True)
        return reload_in_place(self, weights)
