"""GPU: the compiled Triton back-end and the torch back-end on CUDA against float64 (skips on CPU)."""

import pytest
import torch

from megatron_rl.ops import fused_logprob_entropy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


def run(backend, hidden, weight, labels, gl, ge, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = fused_logprob_entropy(h, w, labels, backend=backend, **kw)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    return logp, ent, h.grad, w.grad


def reference(hidden, weight, labels, gl, ge, temperature):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    lp = torch.log_softmax((h @ w.T) / temperature, -1)
    valid = labels != -100
    logp = torch.where(valid, lp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(lp.exp() * lp).sum(-1), 0.0)
    ((logp * gl.double()).sum() + (ent * ge.double()).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backends_match_float64(backend, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v, temp = 1000, 256, 5000, 0.8
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 2 / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::9] = -100
    gl = torch.randn(n, device="cuda", generator=g)
    ge = torch.randn(n, device="cuda", generator=g)
    ours = run(backend, hidden, weight, labels, gl, ge, temperature=temp, chunk_tokens=384,
               chunk_vocab=1500)
    ref = reference(hidden, weight, labels, gl, ge, temp)
    val_tol = 1e-4  # fp32 accumulation (tf32x3 dots for fp32 inputs) whatever the input dtype
    grad_tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (a, b) in enumerate(zip(ours, ref)):
        tol = val_tol if i < 2 else grad_tol
        err = (a.double() - b).abs().max().item()
        assert err <= tol * max(b.abs().max().item(), 1.0), (i, err)
