"""PyTorch chunked back-end: tiles over tokens and vocabulary, never holds more than one tile of logits.

Forward: for each token chunk, run over the vocabulary chunks, computing the tile of scaled logits
``z = (h @ W_v^T) / T`` in fp32 and folding it into the online statistics of :mod:`.stats`; the label
logit is picked from the tile that holds it.

Backward: recompute each tile and form the logit gradient in place,
``dz = g_logp * (onehot - p) + g_ent * p * (E_p[z] - z)`` with ``p = exp(z - lse)``, then
accumulate ``grad_h += dz @ W_v / T`` and ``grad_W_v += dz^T @ h / T``.

Two reusable tile buffers (``chunk_tokens * chunk_vocab`` fp32 each) are the only large temporaries:
reusing them avoids page-faulting fresh memory for every tile on CPU. All outputs are written through
the ``out`` tensors the caller passes, each element written at least once before being accumulated
into, so the caller can hand over uninitialised memory.
"""

from __future__ import annotations

import torch

from .stats import SoftmaxStats, merge_into

# Tile sizes (fp32 bytes per tile buffer: CPU 2048*4096*4 = 32 MiB, GPU 8192*16384*4 = 512 MiB).
# CPU: the sweeps in benchmarks/logprob_entropy.py on the shared 2-core box could not separate
# 1024..4096-wide tiles from noise; GPU: sized for an H200's memory, not yet measured there.
DEFAULT_CHUNKS = {"cpu": (2048, 4096), "cuda": (8192, 16384)}


# torch.mm(..., out_dtype=torch.float32): bf16 operands, fp32 result (CUDA, torch >= 2.8)
_MM_OUT_DTYPE = "out_dtype" in (torch.mm.__doc__ or "") or hasattr(torch.ops.aten.mm, "dtype")


def default_chunks(device: torch.device) -> tuple[int, int]:
    return DEFAULT_CHUNKS.get(device.type, DEFAULT_CHUNKS["cpu"])


class _Tiles:
    """Two flat fp32 buffers handing out contiguous ``[rows, cols]`` views."""

    def __init__(self, chunk_tokens: int, chunk_vocab: int, device: torch.device, n_rows: int,
                 n_cols: int):
        size = min(chunk_tokens, n_rows) * min(chunk_vocab, n_cols)
        self.a = torch.empty(size, dtype=torch.float32, device=device)
        self.b = torch.empty(size, dtype=torch.float32, device=device)

    def views(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows * cols
        return self.a[:n].view(rows, cols), self.b[:n].view(rows, cols)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _label_cols(local_labels: torch.Tensor, v0: int, v1: int):
    """Rows whose label falls in ``[v0, v1)`` and the label's column in the tile."""
    rows = torch.nonzero((local_labels >= v0) & (local_labels < v1)).squeeze(1)
    return rows, local_labels[rows] - v0


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, local_labels: torch.Tensor, *,
                  inv_temp: float, chunk_tokens: int, chunk_vocab: int, out: SoftmaxStats,
                  out_label: torch.Tensor) -> None:
    """Fill ``out`` (m, s, t) and ``out_label`` (the label's scaled logit, 0 when the label is not
    in this shard: ``local_labels < 0``) for ``hidden [N, H]`` against ``weight [V, H]``."""
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    tiles = _Tiles(chunk_tokens, chunk_vocab, hidden.device, n_tok, n_voc)
    want_t = out.t is not None
    for n0 in range(0, n_tok, chunk_tokens):
        n1 = min(n0 + chunk_tokens, n_tok)
        h = hidden[n0:n1].float() * inv_temp  # fold 1/T into the small operand
        labels = local_labels[n0:n1]
        out_label[n0:n1].zero_()
        acc = SoftmaxStats(out.m[n0:n1], out.s[n0:n1], out.t[n0:n1] if want_t else None)
        for v0 in range(0, n_voc, chunk_vocab):
            v1 = min(v0 + chunk_vocab, n_voc)
            z, e = tiles.views(n1 - n0, v1 - v0)
            torch.mm(h, _f32(weight[v0:v1]).t(), out=z)
            rows, cols = _label_cols(labels, v0, v1)
            out_label[n0:n1].index_copy_(0, rows, z[rows, cols])
            m = z.amax(dim=1)
            z.sub_(m[:, None])
            torch.exp(z, out=e)
            s = e.sum(dim=1)
            # row-wise dot of e and z as a batched matmul: reads both, writes nothing big
            t = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) if want_t else None
            if v0 == 0:
                acc.m.copy_(m)
                acc.s.copy_(s)
                if want_t:
                    acc.t.copy_(t)
            else:
                merge_into(acc, SoftmaxStats(m, s, t))


def accumulate_grads(hidden: torch.Tensor, weight: torch.Tensor, tile_grad, *, chunk_tokens: int,
                     chunk_vocab: int, grad_hidden: torch.Tensor | None,
                     grad_weight: torch.Tensor | None, upcast: bool) -> None:
    """The backward tile loop shared by the back-ends.

    ``tile_grad(h, w, n0, n1, v0, v1)`` returns the gradient of the loss with respect to the raw
    logits ``h @ w^T`` of one tile (``h = hidden[n0:n1]``, ``w = weight[v0:v1]``, both fp32 when
    ``upcast``); it is multiplied into the fp32 ``grad_hidden [N, H]`` and ``grad_weight [V, H]``
    (vocabulary chunks outer, so each ``grad_weight`` chunk stays hot while tokens stream by).
    """
    n_tok, n_voc = hidden.shape[0], weight.shape[0]
    for v0 in range(0, n_voc, chunk_vocab):
        v1 = min(v0 + chunk_vocab, n_voc)
        w = _f32(weight[v0:v1]) if upcast else weight[v0:v1]
        for n0 in range(0, n_tok, chunk_tokens):
            n1 = min(n0 + chunk_tokens, n_tok)
            h = _f32(hidden[n0:n1]) if upcast else hidden[n0:n1]
            g = tile_grad(h, w, n0, n1, v0, v1)
            if grad_hidden is not None:
                _mm_into(grad_hidden[n0:n1], g, w, accumulate=v0 > 0)
            if grad_weight is not None:
                _mm_into(grad_weight[v0:v1], g.t(), h, accumulate=n0 > 0)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` with fp32 ``out``; low-precision operands multiply natively (fp32
    accumulation inside the GEMM) when the device supports an fp32 output, else are upcast."""
    if a.dtype == b.dtype == torch.float32:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if a.dtype == b.dtype and a.is_cuda and _MM_OUT_DTYPE:
        prod = torch.mm(a, b, out_dtype=torch.float32)
    else:
        prod = torch.mm(_f32(a), _f32(b))
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


def row_coefficients(inv_temp: float, mean_z: torch.Tensor | None, g_logp: torch.Tensor,
                     g_ent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(a, b, c)`` with ``dL/d(raw logit) = p * (a * z + b) + c * onehot(label)``.

    From ``dlogp/dz = onehot - p`` and ``dH/dz = p * (E[z] - z)`` and ``dz/d(raw) = 1/T``:
    ``a = -g_ent / T``, ``b = (g_ent * E[z] - g_logp) / T``, ``c = g_logp / T`` (``a = 0`` and
    ``b = -g_logp / T`` without an entropy gradient).
    """
    c = g_logp * inv_temp
    if g_ent is None:
        return torch.zeros_like(c), -c, c
    return -inv_temp * g_ent, inv_temp * (g_ent * mean_z - g_logp), c


def backward(hidden: torch.Tensor, weight: torch.Tensor, local_labels: torch.Tensor, *,
             inv_temp: float, lse: torch.Tensor, mean_z: torch.Tensor | None,
             g_logp: torch.Tensor, g_ent: torch.Tensor | None, chunk_tokens: int, chunk_vocab: int,
             grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> None:
    """Write the fp32 gradients of ``sum(g_logp * logp + g_ent * entropy)`` into ``grad_hidden
    [N, H]`` and ``grad_weight [V, H]`` (either may be None to skip it). ``g_ent=None`` skips the
    entropy term; ``mean_z`` is ``E_p[z]``, needed only with ``g_ent``. ``grad_hidden`` is this
    shard's contribution: the caller sums it over vocab-parallel ranks."""
    tiles = _Tiles(chunk_tokens, chunk_vocab, hidden.device, hidden.shape[0], weight.shape[0])
    a, b, c = row_coefficients(inv_temp, mean_z, g_logp, g_ent)
    a, b = a[:, None], b[:, None]

    def tile_grad(h, w, n0, n1, v0, v1):
        z, g = tiles.views(n1 - n0, v1 - v0)
        torch.mm(h * inv_temp, w.t(), out=z)
        torch.sub(z, lse[n0:n1, None], out=g)
        g.exp_()  # p
        if g_ent is not None:
            torch.addcmul(b[n0:n1], z, a[n0:n1], out=z)
            g.mul_(z)
        else:
            g.mul_(b[n0:n1])
        rows, cols = _label_cols(local_labels[n0:n1], v0, v1)
        g[rows, cols] += c[n0:n1][rows]
        return g

    accumulate_grads(hidden, weight, tile_grad, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
                     grad_hidden=grad_hidden, grad_weight=grad_weight, upcast=True)
