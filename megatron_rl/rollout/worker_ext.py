"""Methods added to every vLLM worker (``worker_extension_cls``), called through ``collective_rpc``.

They run inside the worker, next to the model, so weights are loaded by vLLM's own weight loaders
(``reload_weights`` repacks them the way the engine stores them; a plain ``model.load_weights`` after
start-up fails on CPU because the weights were repacked). Checksums of what engines received live with
the weight sync (``megatron_rl.sync.buckets``). Every in-place load goes through :func:`reload_in_place`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def reload_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's in-place reload of HF-named tensors, then :func:`refresh_tied_layers`."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    refresh_tied_layers(worker.model_runner.get_model())


def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Re-run vLLM's post-load processing of every layer that shares its weight with another.

    A tied output layer (``tie_word_embeddings``) has no tensor of its own in a checkpoint, so
    vLLM's layerwise reload processes the embedding (which receives the tensor, filling the shared
    storage) and puts the output layer's kernel state back untouched. On CPU that state is a copy
    of the weight packed at start-up for the GEMM (``UnquantizedEmbeddingMethod.
    process_weights_after_loading`` builds a oneDNN / sgl handle): without this, the engine samples
    from the new body and the base model's output layer. Running the layer's own processing again
    repacks it from the shared weight (on GPUs it is a no-op). Returns how many layers it refreshed.
    """
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


class WeightUpdateExtension:
    """Mixed into vLLM's worker class by vLLM itself."""

    def mrl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors in place; returns the number of tensors loaded."""
        reload_in_place(self, named_tensors)
        return len(named_tensors)
