"""Triton back-end cases; run by test_logprob_entropy_triton.py in a subprocess with
TRITON_INTERPRET=1 (the interpreter is chosen when kernels are defined, so it needs a fresh process).
"""

import os

import pytest
import torch

from megatron_rl.ops import fused_logprob_entropy
from megatron_rl.ops import stats as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (see test_logprob_entropy_triton.py)",
                allow_module_level=True)

from megatron_rl.ops import triton_backend  # noqa: E402  (after the interpreter check)


def run(backend, hidden, weight, labels, g_logp, g_ent, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = fused_logprob_entropy(h, w, labels, backend=backend, **kw)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if g_ent is not None else 0.0)
    loss.backward()
    return logp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


def inputs(n, h, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    labels[1], labels[2] = 0, v - 1
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


def close(a, b, tol):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol * max(b.double().abs().max().item(), 1.0), err


# n, h, v, T, chunk_tokens, chunk_vocab: tiles that do not divide anything, several vocab splits
@pytest.mark.parametrize("case", [(37, 24, 150, 0.7, 20, 64), (16, 16, 32, 1.0, 16, 32),
                                  (40, 24, 200, 1.3, 64, 100)])
def test_triton_equals_torch_fp32(case):
    n, h, v, temp, ct, cv = case
    hidden, weight, labels, gl, ge = inputs(n, h, v, torch.float32, seed=n)
    kw = dict(temperature=temp, chunk_tokens=ct, chunk_vocab=cv)
    ours = run("triton", hidden, weight, labels, gl, ge, **kw)
    ref = run("torch", hidden, weight, labels, gl, ge, **kw)
    for a, b in zip(ours, ref):
        close(a, b, 1e-5)
    # and against float64 directly
    z = (hidden.double() @ weight.double().T) / temp
    lp = torch.log_softmax(z, -1)
    valid = labels != -100
    close(ours[0], torch.where(valid, lp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0), 1e-5)
    close(ours[1], torch.where(valid, -(lp.exp() * lp).sum(-1), 0.0), 1e-5)


def test_triton_bf16_and_entropy_off():
    hidden, weight, labels, gl, ge = inputs(30, 32, 120, torch.bfloat16, seed=4)
    ours = run("triton", hidden, weight, labels, gl, ge, temperature=0.9)
    ref = run("torch", hidden, weight, labels, gl, ge, temperature=0.9)
    close(ours[0], ref[0], 1e-5)
    close(ours[1], ref[1], 1e-5)
    # the logit gradient is rounded to bf16 before the GEMMs on this back-end: within bf16 rounding
    close(ours[2], ref[2], 2e-2)
    close(ours[3], ref[3], 2e-2)
    off = run("triton", hidden.float(), weight.float(), labels, gl, None, compute_entropy=False)
    ref_off = run("torch", hidden.float(), weight.float(), labels, gl, None, compute_entropy=False)
    assert off[1] is None
    for a, b in zip((off[0], off[2], off[3]), (ref_off[0], ref_off[2], ref_off[3])):
        close(a, b, 1e-5)


def test_triton_poisoned_outputs_are_fully_written():
    hidden, weight, labels, gl, ge = inputs(21, 16, 97, torch.float32, seed=5)
    local = torch.where(labels % 3 == 0, -1, labels)  # some labels owned by another shard
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out, label = st.SoftmaxStats(nan(21), nan(21), nan(21)), nan(21)
    triton_backend.forward_stats(hidden, weight, local, inv_temp=1.0, chunk_tokens=0,
                                 chunk_vocab=0, out=out, out_label=label)
    assert all(torch.isfinite(x).all() for x in (out.m, out.s, out.t, label))
    assert (label[local < 0] == 0).all()
    close(st.log_partition(out), torch.logsumexp(hidden.double() @ weight.double().T, -1), 1e-6)
    gh, gw = nan(21, 16), nan(97, 16)
    triton_backend.backward(hidden, weight, local, inv_temp=1.0, lse=st.log_partition(out),
                            mean_z=st.mean_logit(out), g_logp=gl, g_ent=ge, chunk_tokens=8,
                            chunk_vocab=40, grad_hidden=gh, grad_weight=gw)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
