"""Fused per-token log-prob and entropy from the last hidden states and the output-layer weight.

``fused_logprob_entropy`` computes, for every token, the log-probability of its label and the entropy
of the whole next-token distribution ``softmax(h @ W^T / T)``, with an autograd backward for ``h`` and
``W``, without ever forming the ``[N, V]`` logits: the back-end tiles over tokens and vocabulary (see
:mod:`.torch_backend`, :mod:`.triton_backend`) and recomputes tiles in the backward pass.

Vocab-parallel: ``weight`` is this rank's shard (rank r of ``tp_group`` holds vocabulary rows
``[r * V_local, (r + 1) * V_local)``) and ``hidden`` is the same on every rank of the group. The
per-rank statistics are combined with two all-reduces (:func:`.stats.all_reduce_stats`), so every
rank gets the unsplit results. In the backward pass the hidden-state gradient is summed over the group
here, so it is the full gradient on every rank (with sequence parallelism, gather the hidden states
with a gather whose backward only splits, e.g. Megatron's
``gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)``); the weight gradient
is this rank's shard.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.distributed as dist

from . import stats as st
from . import torch_backend

# back-end name -> module with forward_stats / backward / default_chunks (see torch_backend)
_BACKENDS = {"torch": "megatron_rl.ops.torch_backend", "triton": "megatron_rl.ops.triton_backend"}


def get_backend(name: str, device: torch.device) -> ModuleType:
    """The back-end module for ``name`` ("auto": Triton on CUDA when importable, else torch)."""
    if name == "auto":
        if device.type == "cuda":
            try:
                return importlib.import_module(_BACKENDS["triton"])
            except ImportError:
                return torch_backend
        return torch_backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *_BACKENDS]}, got {name!r}")
    return importlib.import_module(_BACKENDS[name])


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, local_labels, valid, inv_temp, tp_group, compute_entropy,
                backend, chunk_tokens, chunk_vocab):
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        stats = st.SoftmaxStats(torch.empty(n, **f32), torch.empty(n, **f32),
                                torch.empty(n, **f32) if compute_entropy else None)
        label_logit = torch.empty(n, **f32)
        backend.forward_stats(hidden, weight, local_labels, inv_temp=inv_temp,
                              chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, out=stats,
                              out_label=label_logit)
        if tp_group is not None:
            st.all_reduce_stats(stats, label_logit, tp_group)
        lse = st.log_partition(stats)
        logp = torch.where(valid, label_logit - lse, 0.0)
        entropy = torch.where(valid, st.entropy(stats), 0.0) if compute_entropy else None
        mean_z = st.mean_logit(stats) if compute_entropy else None
        ctx.save_for_backward(hidden, weight, local_labels, valid, lse, mean_z)
        ctx.cfg = (inv_temp, tp_group, backend, chunk_tokens, chunk_vocab)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local_labels, valid, lse, mean_z = ctx.saved_tensors
        inv_temp, tp_group, backend, chunk_tokens, chunk_vocab = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 10
        zeros = torch.zeros_like(lse)
        g_logp = zeros if g_logp is None else torch.where(valid, g_logp.float(), 0.0)
        if g_ent is not None:
            g_ent = torch.where(valid, g_ent.float(), 0.0)
        f32 = dict(dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, **f32) if need_h else None
        grad_w = torch.empty(weight.shape, **f32) if need_w else None
        backend.backward(hidden, weight, local_labels, inv_temp=inv_temp, lse=lse, mean_z=mean_z,
                         g_logp=g_logp, g_ent=g_ent, chunk_tokens=chunk_tokens,
                         chunk_vocab=chunk_vocab, grad_hidden=grad_h, grad_weight=grad_w)
        if grad_h is not None and tp_group is not None:
            dist.all_reduce(grad_h, group=tp_group)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return (grad_h, grad_w) + (None,) * 8


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          temperature: float = 1.0, tp_group=None, compute_entropy: bool = True,
                          ignore_index: int = -100, backend: str = "auto",
                          chunk_tokens: int | None = None, chunk_vocab: int | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log p(label)`` and entropy of ``softmax(hidden @ weight^T / temperature)``.

    Args:
        hidden: ``[..., H]`` last hidden states (any float dtype; math is fp32).
        weight: ``[V_local, H]`` output-layer weight, this rank's vocabulary shard under TP.
        labels: ``[...]`` long, global vocabulary ids; ``ignore_index`` entries give 0 and no grad.
        temperature: divides the logits (> 0).
        tp_group: the vocab-parallel ``torch.distributed`` group, or None when unsplit.
        compute_entropy: False returns ``None`` for the entropy and skips its work.
        backend: "auto", "torch" or "triton".
        chunk_tokens, chunk_vocab: tile size (defaults per back-end and device).

    Returns:
        ``(logp, entropy)``, fp32 with the shape of ``labels``; ``entropy`` is None when
        ``compute_entropy`` is False. Backward gives grads for ``hidden`` and ``weight``; when the
        entropy's gradient is not used (None) its term is skipped.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)} vs "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for name, val in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if val is not None and val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    impl = get_backend(backend, hidden.device)
    default_t, default_v = impl.default_chunks(hidden.device)
    lead = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    lab = labels.reshape(-1).long()

    v_local = weight.shape[0]
    rank, world = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group else (0, 1)
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= v_local * world))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"labels[{i}] = {int(lab[i])} outside the vocabulary [0, {v_local * world}) "
                         f"and not ignore_index ({ignore_index})")
    if lab.numel() == 0:
        empty = torch.zeros(lead, dtype=torch.float32, device=hidden.device)
        return empty, (empty.clone() if compute_entropy else None)
    local = lab - rank * v_local
    local = torch.where(valid & (local >= 0) & (local < v_local), local, -1)

    logp, ent = _FusedLogprobEntropy.apply(
        h2, w, local, valid, 1.0 / float(temperature), tp_group, compute_entropy, impl,
        chunk_tokens or default_t, chunk_vocab or default_v)
    return logp.view(lead), (ent.view(lead) if ent is not None else None)
