"""Our SDPA core attention against Megatron's DotProductAttention (in this process, one gloo rank).

Both modules are built by Megatron from the same TransformerConfig; forward outputs and the
gradients of q, k, v under one fixed upstream gradient must agree to 2e-6 absolute (fp32; observed
~1e-6: the two sum in different orders). Cases: causal without a mask, explicit causal + padding mask
(right-padded batch), a padding mask with fully masked rows (Megatron: uniform attention), MHA and
GQA, a non-default softmax scale with query-key layer scaling, a single query (no causal mask).
The memory test counts the CPU allocator's bytes (torch profiler) over one forward + backward.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

SEQ, BATCH, HEAD_DIM = 12, 3, 16


@pytest.fixture(scope="module")
def pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed

    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    init_distributed(ParallelConfig())
    yield ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    destroy_distributed()


def _config(heads, groups, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=HEAD_DIM,
                             use_cpu_initialization=True, attention_dropout=0.0,
                             hidden_dropout=0.0, **kw)


def _modules(config, pg, mask_type, layer_number=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl.models.attention import SDPAttention

    args = (config, layer_number, mask_type, "self")
    return DotProductAttention(*args, pg_collection=pg), SDPAttention(*args, pg_collection=pg)


def _run(module, q, k, v, mask):
    from megatron_rl.compat import megatron_cpu_scope

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with megatron_cpu_scope():
        out = module(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(sq, heads, groups, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or sq
    return (torch.randn(sq, BATCH, heads, HEAD_DIM, generator=g),
            torch.randn(sk, BATCH, groups, HEAD_DIM, generator=g),
            torch.randn(sk, BATCH, groups, HEAD_DIM, generator=g))


def _masks():
    lengths = torch.tensor([SEQ, 7, 1])
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]  # [b, s] True = padding
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return {
        "none": None,
        "causal_padded": pad[:, None, None, :] | causal,
        # padding queries see nothing: whole rows masked
        "padding_rows": pad[:, None, None, :] | pad[:, None, :, None],
    }


@pytest.mark.parametrize("mask_name", ["none", "causal_padded", "padding_rows"])
@pytest.mark.parametrize("mask_type", ["causal", "padding"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_attention_equals_dot_product_attention(pg, mask_type, mask_name, heads, groups):
    from megatron.core.transformer.enums import AttnMaskType

    ref, ours = _modules(_config(heads, groups), pg, getattr(AttnMaskType, mask_type))
    q, k, v = _inputs(SEQ, heads, groups)
    mask = _masks()[mask_name]
    want, got = _run(ref, q, k, v, mask), _run(ours, q, k, v, mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        assert a.shape == b.shape, name
        assert float((a - b).abs().max()) < 2e-6, (name, float((a - b).abs().max()))
    if mask_name == "none" and mask_type == "causal":  # the causal mask took effect
        full = _run(_modules(_config(heads, groups), pg, AttnMaskType.no_mask)[1], q, k, v, None)
        assert float((full[0] - got[0]).abs().max()) > 1e-2


def test_attention_scale_layer_scaling_and_single_query(pg):
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(4, 2, softmax_scale=0.37, apply_query_key_layer_scaling=True,
                     attention_softmax_in_fp32=True)
    ref, ours = _modules(config, pg, AttnMaskType.causal, layer_number=2)
    for sq in (SEQ, 1):  # one query: no causal mask in either
        q, k, v = _inputs(sq, 4, 2, sk=SEQ)
        want, got = _run(ref, q, k, v, None), _run(ours, q, k, v, None)
        for a, b in zip(want, got):
            assert float((a - b).abs().max()) < 2e-6


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_packed_sequences_attend_within_each_sequence(pg, heads, groups):
    """THD (packed sequences, ``cu_seqlens``): equal to Megatron's DotProductAttention over the whole
    row with a block-diagonal causal mask, forward and gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    ref, ours = _modules(_config(heads, groups), pg, AttnMaskType.causal)
    bounds = [0, 5, 6, 13, 20, 26, 33]  # segments of 5, 1, 7, 7, 6, 7 tokens
    t = bounds[-1]
    q, k, v = (x[:, :1] for x in _inputs(t, heads, groups))  # [t, 1, h, d]
    visible = torch.zeros(t, t, dtype=torch.bool)
    for a, b in zip(bounds, bounds[1:]):
        visible[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    want = _run(ref, q, k, v, ~visible[None, None])
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=7,
                             max_seqlen_kv=7)

    def packed(q, k, v, _mask):  # Megatron's attention squeezes the batch dimension for THD
        return ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)[:, None]

    got = _run(packed, q, k, v, None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        assert a.shape == b.shape, name
        assert float((a - b).abs().max()) < 2e-6, (name, float((a - b).abs().max()))


def test_attention_refuses_what_it_does_not_do(pg):
    from megatron.core.transformer.enums import AttnMaskType

    _, ours = _modules(_config(4, 2), pg, AttnMaskType.causal)
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = _inputs(SEQ, 4, 2)
    with pytest.raises(ValueError, match="packed sequences need qkv_format 'thd'"):
        ours(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="softmax_type"):
        _modules(_config(4, 2, softmax_type="off-by-one"), pg, AttnMaskType.causal)


def _peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_attention_never_holds_the_score_matrix(pg):
    from megatron.core.transformer.enums import AttnMaskType

    seq, heads, groups = 1024, 4, 2
    ref, ours = _modules(_config(heads, groups), pg, AttnMaskType.causal)
    q, k, v = _inputs(seq, heads, groups)
    scores = BATCH * heads * seq * seq * 4  # one fp32 [b, np, s, s] buffer
    ref_peak = _peak_bytes(lambda: _run(ref, q, k, v, None))
    our_peak = _peak_bytes(lambda: _run(ours, q, k, v, None))
    assert ref_peak >= scores  # the measurement sees Megatron's score matrix
    assert our_peak < scores / 4, (our_peak, scores)
