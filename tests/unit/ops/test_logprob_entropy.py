"""fused_logprob_entropy (torch back-end) against a float64 full-softmax reference."""

import pytest
import torch

from megatron_rl.ops import fused_logprob_entropy
from megatron_rl.ops import stats as st
from megatron_rl.ops import torch_backend

IGN = -100


def reference(hidden, weight, labels, temperature, ignore_index=IGN):
    """float64, materialised logits: (logp, entropy) with ignored tokens set to 0."""
    z = (hidden.double() @ weight.double().T) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0)


def make(n, h, v, dtype, seed=0, scale=1.0, n_ignored=2):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[:n_ignored]] = IGN
    return hidden, weight, labels


def grads_ours(hidden, weight, labels, g_logp, g_ent, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = fused_logprob_entropy(h, w, labels, **kw)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if g_ent is not None else 0.0)
    loss.backward()
    return logp, ent, h.grad, w.grad


def grads_ref(hidden, weight, labels, g_logp, g_ent, temperature):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp, ent = reference(h, w, labels, temperature)
    loss = (logp * g_logp.double()).sum() + ((ent * g_ent.double()).sum() if g_ent is not None else 0)
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def assert_close(ours, ref, tol, what):
    err = (ours.double() - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-12
    assert err <= tol * max(scale, 1.0), f"{what}: max abs err {err:.3g} (ref scale {scale:.3g})"


# (N, H, V, chunk_tokens, chunk_vocab): divisible, non-divisible, single tile, chunk > size
SHAPES = [(64, 32, 256, 16, 64), (37, 24, 101, 10, 17), (5, 8, 50, 8, 64), (50, 16, 300, 7, 300),
          (33, 16, 129, 1, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_fp32_matches_float64_reference_values_and_grads(shape, temperature):
    n, h, v, ct, cv = shape
    hidden, weight, labels = make(n, h, v, torch.float32, seed=n + v)
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ours = grads_ours(hidden, weight, labels, g_logp, g_ent, temperature=temperature,
                      chunk_tokens=ct, chunk_vocab=cv, backend="torch")
    ref = grads_ref(hidden, weight, labels, g_logp, g_ent, temperature)
    for o, r, what in zip(ours, ref, ["logp", "entropy", "grad_hidden", "grad_weight"]):
        assert o.dtype == (torch.float32)
        assert_close(o, r, 2e-5, what)


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, labels = make(40, 64, 200, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(2)
    g_logp, g_ent = torch.randn(40, generator=g), torch.randn(40, generator=g)
    logp, ent, gh, gw = grads_ours(hidden, weight, labels, g_logp, g_ent, temperature=0.8,
                                   chunk_tokens=16, chunk_vocab=48)
    # the reference sees exactly the same bf16 numbers, upcast: only accumulation error remains
    rl, re, rgh, rgw = grads_ref(hidden, weight, labels, g_logp, g_ent, 0.8)
    assert logp.dtype == ent.dtype == torch.float32
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert_close(logp, rl, 2e-5, "logp")  # fp32-accurate, far below bf16's 4e-3
    assert_close(ent, re, 2e-5, "entropy")
    assert_close(gh, rgh, 1e-2, "grad_hidden")  # grads are rounded to bf16 at the end only
    assert_close(gw, rgw, 1e-2, "grad_weight")


def test_large_logits_stay_accurate():
    # logits of size ~ +-200: a naive exp overflows, a sum of p*z cancels badly
    hidden, weight, labels = make(24, 16, 80, torch.float32, seed=5, scale=60.0)
    logp, ent = fused_logprob_entropy(hidden, weight, labels, chunk_tokens=8, chunk_vocab=24)
    rl, re = reference(hidden, weight, labels, 1.0)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert_close(logp, rl, 1e-5, "logp")
    assert (ent.double() - re).abs().max() < 1e-4


def test_entropy_grad_skipped_when_unused_or_off():
    hidden, weight, labels = make(30, 16, 90, torch.float32, seed=7)
    g_logp = torch.randn(30, generator=torch.Generator().manual_seed(0))
    _, _, rgh, rgw = grads_ref(hidden, weight, labels, g_logp, None, 1.3)
    # entropy computed but not in the loss: its grad arrives as None and its term is skipped
    _, ent, gh, gw = grads_ours(hidden, weight, labels, g_logp, None, temperature=1.3,
                                chunk_tokens=9, chunk_vocab=40)
    assert ent is not None
    assert_close(gh, rgh, 2e-5, "grad_hidden")
    assert_close(gw, rgw, 2e-5, "grad_weight")
    logp, ent, gh2, gw2 = grads_ours(hidden, weight, labels, g_logp, None, temperature=1.3,
                                     compute_entropy=False, chunk_tokens=9, chunk_vocab=40)
    assert ent is None
    assert_close(gh2, rgh, 2e-5, "grad_hidden (entropy off)")
    assert_close(gw2, rgw, 2e-5, "grad_weight (entropy off)")


def test_ignored_tokens_are_zero_and_get_no_gradient():
    hidden, weight, labels = make(20, 8, 40, torch.float32, seed=9, n_ignored=0)
    labels[[2, 11, 19]] = -1
    g = torch.ones(20)
    logp, ent, gh, _ = grads_ours(hidden, weight, labels, g, g, ignore_index=-1, chunk_tokens=6,
                                  chunk_vocab=16)
    ign = labels == -1
    assert (logp[ign] == 0).all() and (ent[ign] == 0).all()
    assert (gh[ign] == 0).all()
    assert (gh[~ign].abs().sum(-1) > 0).all()
    assert (logp[~ign] < 0).all() and (ent[~ign] > 0).all()


def test_leading_dims_and_int32_labels():
    hidden, weight, labels = make(24, 8, 30, torch.float32, seed=11)
    logp, ent = fused_logprob_entropy(hidden.view(2, 3, 4, 8), weight, labels.view(2, 3, 4).int())
    rl, re = reference(hidden, weight, labels, 1.0)
    assert logp.shape == ent.shape == (2, 3, 4)
    assert_close(logp.reshape(-1), rl, 2e-5, "logp")
    assert_close(ent.reshape(-1), re, 2e-5, "entropy")


def test_empty_input():
    hidden, weight, _ = make(4, 8, 10, torch.float32)
    logp, ent = fused_logprob_entropy(hidden[:0], weight, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)


def test_bad_input_is_named():
    hidden, weight, labels = make(6, 8, 10, torch.float32)
    labels[4] = 10
    with pytest.raises(ValueError, match=r"labels\[4\] = 10 outside the vocabulary \[0, 10\)"):
        fused_logprob_entropy(hidden, weight, labels)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprob_entropy(hidden, weight, labels.clamp(0, 9), temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        fused_logprob_entropy(hidden, weight, labels.clamp(0, 9), backend="cuda-magic")
    with pytest.raises(ValueError, match="labels shape"):
        fused_logprob_entropy(hidden, weight, labels[:5])


def test_poisoned_outputs_are_fully_written():
    """Back-end outputs handed over as NaN: every element must be overwritten, not accumulated into."""
    hidden, weight, labels = make(23, 8, 45, torch.float32, seed=13, n_ignored=0)
    local = labels.clone()
    local[::4] = -1  # labels owned by another shard: label logit must still be written (as 0)
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out = st.SoftmaxStats(nan(23), nan(23), nan(23))
    label = nan(23)
    torch_backend.forward_stats(hidden, weight, local, inv_temp=1.0, chunk_tokens=5, chunk_vocab=7,
                                out=out, out_label=label)
    for name, x in [("m", out.m), ("s", out.s), ("t", out.t), ("label", label)]:
        assert torch.isfinite(x).all(), name
    z = hidden.double() @ weight.double().T
    assert_close(st.log_partition(out), torch.logsumexp(z, -1), 1e-6, "lse")
    assert (label[::4] == 0).all()
    gh, gw = nan(23, 8), nan(45, 8)
    lse, mean_z = st.log_partition(out), st.mean_logit(out)
    torch_backend.backward(hidden, weight, local, inv_temp=1.0, lse=lse, mean_z=mean_z,
                           g_logp=torch.ones(23), g_ent=torch.ones(23), chunk_tokens=5,
                           chunk_vocab=7, grad_hidden=gh, grad_weight=gw)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_config_validates_and_feeds_the_op():
    from megatron_rl.config.base import ConfigError
    from megatron_rl.ops import LogprobOpsConfig

    with pytest.raises(ConfigError, match="ops.chunk_vocab"):
        LogprobOpsConfig.from_dict({"chunk_vocab": 0}, prefix="ops").validate()
    with pytest.raises(ConfigError, match="ops.backend"):
        LogprobOpsConfig.from_dict({"backend": "cudnn"}, prefix="ops")
    cfg = LogprobOpsConfig.from_dict({"backend": "torch", "chunk_tokens": 4, "chunk_vocab": 9})
    cfg.validate()
    hidden, weight, labels = make(10, 8, 20, torch.float32)
    logp, _ = fused_logprob_entropy(hidden, weight, labels, **cfg.op_kwargs())
    assert_close(logp, reference(hidden, weight, labels, 1.0)[0], 2e-5, "logp")
