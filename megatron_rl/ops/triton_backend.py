"""Triton back-end: the logits tiles live in registers only.

Forward: one launch, grid ``(token blocks, vocabulary splits)``. Each program walks its split of the
vocabulary in ``BLOCK_V`` steps, computes the ``[BLOCK_N, BLOCK_V]`` tile of scaled logits with
``tl.dot`` (fp32 accumulation) and folds it into running ``(m, s, t)`` and the label logit; the
per-split partials (``[splits, N]``) are merged in PyTorch with the same algebra as the
vocab-parallel combine. Nothing of size ``N x V`` is written.

Backward: the shared tile loop of :func:`.torch_backend.accumulate_grads`; for each tile one kernel
recomputes the logits and writes the logit gradient ``p * (a * z + b) + c * onehot`` straight from
registers, and cuBLAS multiplies it into the hidden and weight gradients.

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (set before this module is
imported), which is how the tests check it. The interpreter computes ``tl.dot`` on bf16 operands
wrongly (triton 3.9), so under the interpreter operands are upcast to fp32 before the dot; on GPUs
bf16/fp16 operands go to the tensor cores natively and fp32 operands use ``tf32x3`` (fp32-level
accuracy).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import torch_backend
from .stats import SoftmaxStats

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_NEG = tl.constexpr(-1.0e30)  # "minus infinity" that keeps (x - m) * 0 == 0 instead of NaN

# (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages); the interpreter wants small tiles
_FWD_CFG = (16, 32, 16, 1, 1) if _INTERPRET else (64, 128, 64, 8, 3)
_BWD_CFG = (16, 32, 16, 1, 1) if _INTERPRET else (64, 128, 64, 8, 3)


def default_chunks(device: torch.device) -> tuple[int, int]:
    """Backward tile sizes (the forward needs none)."""
    return (64, 96) if _INTERPRET else (8192, 16384)


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, n_rows, n_cols, H, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``h[rows] @ w[cols]^T`` for one ``[BLOCK_N, BLOCK_V]`` tile (out-of-range -> 0)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        h = tl.load(h_rows + k[None, :], mask=(rows[:, None] < n_rows) & (k[None, :] < H), other=0.0)
        w = tl.load(w_rows + k[None, :], mask=(cols[:, None] < n_cols) & (k[None, :] < H), other=0.0)
        if DOT_F32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, t_ptr, lab_out_ptr, N, V, H, stride_h,
                stride_w, inv_temp, v_per_split,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                WANT_T: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
    v_start = split * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    m = tl.full((BLOCK_N,), _NEG, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    lab = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(h_ptr, w_ptr, rows, cols, N, v_end, H, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_K, DOT_F32, PRECISION) * inv_temp
        z = tl.where(col_ok[None, :], z, _NEG)
        hit = col_ok[None, :] & (cols[None, :] == labels[:, None])
        lab += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        d = z - m_new[:, None]
        e = tl.exp(d)
        if WANT_T:
            t = scale * (t + (m - m_new) * s) + tl.sum(tl.where(col_ok[None, :], e * d, 0.0), axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(lab_out_ptr + out, lab, mask=row_ok)
    if WANT_T:
        tl.store(t_ptr + out, t, mask=row_ok)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, dz_ptr, n_rows, n_cols, H,
                    stride_h, stride_w, stride_dz, inv_temp, label_offset,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    z = _logits_tile(h_ptr, w_ptr, rows, cols, n_rows, n_cols, H, stride_h, stride_w,
                     BLOCK_N, BLOCK_V, BLOCK_K, DOT_F32, PRECISION) * inv_temp
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
    labels = tl.load(lab_ptr + rows, mask=row_ok, other=-1) - label_offset
    p = tl.exp(z - lse[:, None])
    dz = p * (a[:, None] * z + b[:, None])
    dz += tl.where(cols[None, :] == labels[:, None], c[:, None], 0.0)
    ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < n_cols))


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    if _INTERPRET:
        return True, "ieee"
    # fp32 operands: three TF32 passes (fp32-level accuracy on tensor cores); the precision
    # setting is ignored for bf16 / fp16 operands, which always accumulate in fp32
    return False, ("tf32x3" if dtype == torch.float32 else "tf32")


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, local_labels: torch.Tensor, *,
                  inv_temp: float, chunk_tokens: int, chunk_vocab: int, out: SoftmaxStats,
                  out_label: torch.Tensor) -> None:
    """Same contract as :func:`.torch_backend.forward_stats` (the chunk sizes are not used)."""
    n_tok, hid = hidden.shape
    n_voc = weight.shape[0]
    bn, bv, bk, warps, stages = _FWD_CFG
    token_blocks = triton.cdiv(n_tok, bn)
    # enough programs to fill the GPU: split the vocabulary until ~4 programs per SM
    # (the interpreter pretends to have 2 SMs, so small tests get several blocks per split)
    sms = 2 if _INTERPRET else torch.cuda.get_device_properties(hidden.device).multi_processor_count
    splits = max(1, min(triton.cdiv(4 * sms, token_blocks), triton.cdiv(n_voc, bv)))
    v_per_split = triton.cdiv(triton.cdiv(n_voc, splits), bv) * bv
    splits = triton.cdiv(n_voc, v_per_split)
    part = torch.empty((4, splits, n_tok), dtype=torch.float32, device=hidden.device)
    want_t = out.t is not None
    dot_f32, precision = _dot_mode(hidden.dtype)
    _fwd_kernel[(token_blocks, splits)](
        hidden, weight, local_labels, part[0], part[1], part[2], part[3], n_tok, n_voc, hid,
        hidden.stride(0), weight.stride(0), inv_temp, v_per_split,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, WANT_T=want_t, DOT_F32=dot_f32, PRECISION=precision,
        num_warps=warps, num_stages=stages)
    m_part, s_part, t_part, lab_part = part
    m = m_part.amax(dim=0)
    scale = torch.exp(m_part - m)
    out.m.copy_(m)
    out.s.copy_((scale * s_part).sum(dim=0))
    if want_t:
        out.t.copy_((scale * (t_part + (m_part - m) * s_part)).sum(dim=0))
    out_label.copy_(lab_part.sum(dim=0))


def backward(hidden: torch.Tensor, weight: torch.Tensor, local_labels: torch.Tensor, *,
             inv_temp: float, lse: torch.Tensor, mean_z: torch.Tensor | None,
             g_logp: torch.Tensor, g_ent: torch.Tensor | None, chunk_tokens: int, chunk_vocab: int,
             grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> None:
    """Same contract as :func:`.torch_backend.backward`."""
    a, b, c = torch_backend.row_coefficients(inv_temp, mean_z, g_logp, g_ent)
    bn, bv, bk, warps, stages = _BWD_CFG
    dot_f32, precision = _dot_mode(hidden.dtype)
    rows_max, cols_max = min(chunk_tokens, hidden.shape[0]), min(chunk_vocab, weight.shape[0])
    # the logit gradient tile in the operands' dtype (bf16 GEMMs accumulate in fp32 anyway)
    buf = torch.empty(rows_max * cols_max, dtype=hidden.dtype, device=hidden.device)

    def tile_grad(h, w, n0, n1, v0, v1):
        dz = buf[: (n1 - n0) * (v1 - v0)].view(n1 - n0, v1 - v0)
        grid = (triton.cdiv(n1 - n0, bn), triton.cdiv(v1 - v0, bv))
        _dlogits_kernel[grid](
            h, w, local_labels[n0:n1], lse[n0:n1], a[n0:n1], b[n0:n1], c[n0:n1], dz, n1 - n0,
            v1 - v0, h.shape[1], h.stride(0), w.stride(0), dz.stride(0), inv_temp, v0,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, DOT_F32=dot_f32, PRECISION=precision,
            num_warps=warps, num_stages=stages)
        return dz

    torch_backend.accumulate_grads(hidden, weight, tile_grad, chunk_tokens=chunk_tokens,
                                   chunk_vocab=chunk_vocab, grad_hidden=grad_hidden,
                                   grad_weight=grad_weight, upcast=False)
