"""processed_logprobs (top-k / top-p as vLLM applies them) against a per-row float64 reference."""

import pytest
import torch

from megatron_rl.ops import fused_logprob_entropy, processed_logprobs


def kept_set(z, top_k, top_p):
    """float64 textbook definition for one row: the top-k (ties with the k-th included), then the
    tokens whose strictly-higher mass within that set is < p."""
    order = sorted(range(len(z)), key=lambda i: -z[i].item())
    keep = order
    if top_k is not None:
        kth = z[order[top_k - 1]].item()
        keep = [i for i in order if z[i].item() >= kth]
    if top_p is None:
        return set(keep)
    probs = torch.softmax(z[torch.tensor(keep)].double(), 0)
    out, above = set(), 0.0
    for i, pi in zip(keep, probs.tolist()):
        if above < top_p:
            out.add(i)
        above += pi
    return out


def reference_logp(z, label, top_k, top_p):
    """log-prob of ``label`` renormalised over the kept set (the label forced in)."""
    idx = torch.tensor(sorted(kept_set(z.detach(), top_k, top_p) | {label}))
    return z[label] - torch.logsumexp(z[idx], 0)


def make(n, h, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 3 / h**0.5  # peaked enough that top-p bites
    logits = hidden.double() @ weight.double().T
    # labels drawn from the model itself, as sampled tokens are
    labels = torch.multinomial(torch.softmax(logits, -1).float(), 1, generator=g).squeeze(1)
    return hidden, weight, labels


@pytest.mark.parametrize("top_k,top_p,temperature", [(None, None, 1.0), (5, None, 0.7),
                                                     (None, 0.8, 1.0), (8, 0.9, 1.3),
                                                     (3, 0.5, 0.6), (0, 1.0, 1.0)])
def test_matches_float64_reference(top_k, top_p, temperature):
    hidden, weight, labels = make(23, 16, 40, seed=top_k or 1)
    ours = processed_logprobs(hidden, weight, labels, temperature=temperature, top_k=top_k,
                              top_p=top_p, chunk_tokens=7)
    k = top_k if top_k else None
    p = top_p if top_p is not None and top_p < 1 else None
    z = (hidden.double() @ weight.double().T) / temperature
    ref = torch.stack([reference_logp(z[i], int(labels[i]), k, p) for i in range(23)])
    assert (ours.double() - ref).abs().max() < 1e-5
    if k is None and p is None:
        fused, _ = fused_logprob_entropy(hidden, weight, labels, temperature=temperature)
        assert (fused - ours).abs().max() < 1e-5
    else:  # the masks really change something
        plain, _ = fused_logprob_entropy(hidden, weight, labels, temperature=temperature)
        assert (ours - plain).abs().max() > 1e-3


def test_gradient_matches_masked_reference_and_ignore_index():
    hidden, weight, labels = make(12, 8, 30, seed=3)
    labels[4] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = processed_logprobs(h, w, labels, temperature=0.8, top_k=6, top_p=0.85, chunk_tokens=5)
    g = torch.randn(12, generator=torch.Generator().manual_seed(0))
    (logp * g).sum().backward()
    assert logp[4] == 0 and (h.grad[4] == 0).all()
    # reference: same kept set (from the float64 definition), autograd in float64
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = (hd @ wd.T) / 0.8
    rows = [z[i, 0] * 0 if labels[i] == -100 else reference_logp(z[i], int(labels[i]), 6, 0.85)
            for i in range(12)]
    ref = torch.stack(rows)
    (ref * g.double()).sum().backward()
    assert (logp.double() - ref.detach()).abs().max() < 1e-5
    assert (h.grad.double() - hd.grad).abs().max() < 1e-5
    assert (w.grad.double() - wd.grad).abs().max() < 1e-5


def test_bad_input_is_named():
    hidden, weight, labels = make(4, 8, 10, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        processed_logprobs(hidden, weight, labels, top_p=0.0)
    labels[2] = 12
    with pytest.raises(ValueError, match=r"labels\[2\] = 12"):
        processed_logprobs(hidden, weight, labels)
