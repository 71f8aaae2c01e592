"""The CPU shim: Megatron's CUDA-only spots run on the CPU, and nothing changes when CUDA exists.

The shim patches process-wide state, so the before/after checks run in fresh interpreters (two: a
gloo world, for the MoE pieces too); the behaviour checks (gradient clipping, the RNG tracker) run here against float64 / plain-torch
references.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.compat import apply_cpu_shim, cpu_shim_active, megatron_cpu_scope

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shim is inactive with CUDA")


REPO = Path(__file__).resolve().parents[3]


def _run(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# One pair of fresh interpreters (the two ranks of a gloo world) for every check that needs one (a
# Megatron import costs seconds): each prints one labelled line per fact, in this order, and each
# test below reads its own lines.
#   1. before the shim: a CUDA tensor, and Megatron's per-CP-rank rotary slice, fail on this machine;
#   2. before apply_compat, the MoE layers' pieces (the router's linear, the alltoall dispatcher's
#      side stream and split sizes, the uneven expert-TP gather over gloo; both ranks);
#   3. the shim applied (twice): scoped device mode, Megatron's schedules module, the rotary slice;
#   4. Megatron's gradient clipping over a one-rank group (the tensors saved for a float64 check);
#   5. init_distributed refuses before compat.apply_compat(), which adds the Megatron fixes once;
#      after it, the MoE pieces again; init_distributed then builds its groups over both ranks.
FRESH = """
import sys
import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
from megatron.core.transformer.moe import moe_utils, token_dispatcher

tmp, rank = sys.argv[1], int(sys.argv[2])

class Group:  # the CP group's size and this rank's place in it
    def size(self): return 2
    def rank(self): return 1

emb = torch.arange(8.0)[:, None, None, None]  # positions 0..7, 4 chunks of 2
try:
    torch.zeros(1, device="cuda")
    print("cuda before: ok")
except (RuntimeError, AssertionError, AttributeError):
    print("cuda before: fails")
try:
    rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, Group())
    print("rotary before: ok")
except (RuntimeError, AssertionError):
    print("rotary before: fails")

# the MoE pieces
x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
splits = torch.tensor([3, 2])

def router_linear():
    out = moe_utils.router_gating_linear(x, w, None, torch.float64)
    out.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = x @ w.t()
    ref.square().sum().backward()
    ok = torch.equal(out, ref) and torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    x.grad = w.grad = None
    return ok

def dispatcher():
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=2,
                            moe_router_topk=2, moe_ffn_hidden_size=4, use_cpu_initialization=True,
                            moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    d = token_dispatcher.MoEAlltoAllTokenDispatcher(
        2, [0, 1], config=cfg, pg_collection=moe_utils.get_default_pg_collection())
    # the step that copies the routing counts to the host on the side stream
    d.input_splits = d.output_splits = d.output_splits_tp = splits
    d.num_out_tokens = torch.tensor(5)
    d.num_global_tokens_per_local_expert = torch.tensor([[3, 2]])
    d.cuda_dtoh_point = d.cuda_sync_point = "before_permutation_1"
    d._maybe_dtoh_and_synchronize("before_permutation_1", torch.tensor([3, 2]))
    return type(d.input_splits).__name__

def uneven():
    from megatron.core.tensor_parallel import mappings
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # (the CPU shim's; not what is checked)
    sizes = [3, 1]
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 10 * rank
    full = torch.cat([torch.arange(n * 2, dtype=torch.float64).reshape(-1, 2) + 10 * r
                      for r, n in enumerate(sizes)])
    try:
        return f"gather {torch.equal(mappings._gather_along_first_dim(mine, dist.group.WORLD, sizes), full)}"
    except Exception as exc:
        return f"gather fails {type(exc).__name__}"
    finally:
        torch.cuda.current_device = real

def moe(phase):
    for name, fn in (("router", router_linear), ("dispatcher", dispatcher), ("uneven", uneven)):
        try:
            print(f"moe {phase} {name}:", fn())
        except Exception as exc:
            print(f"moe {phase} {name}: fails {type(exc).__name__}")
    print(f"moe {phase} splits:", type(token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)).__name__)
    dist.barrier()

dist.init_process_group("gloo", store=dist.FileStore(tmp + "/store", 2), rank=rank, world_size=2)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel()
moe("before")

from megatron_rl.compat import apply_cpu_shim, cpu_shim_active, megatron_cpu_scope
depth = torch._C._len_torch_function_stack()
assert apply_cpu_shim() and apply_cpu_shim() and cpu_shim_active()
print("global modes added:", torch._C._len_torch_function_stack() - depth)
with megatron_cpu_scope():
    print("in scope:", torch.zeros(1, device="cuda").device)
from megatron.core.pipeline_parallel import schedules
print("schedules:", schedules.torch.zeros([], dtype=torch.int, device="cuda").device)
for fn in (rope_utils.get_pos_emb_on_this_cp_rank, rotary_pos_embedding.get_pos_emb_on_this_cp_rank):
    print("rotary after:", fn(emb, 0, Group()).flatten().tolist())
print("rotary modes left:", torch._C._len_torch_function_stack())

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
own = [dist.new_group([r]) for r in range(2)][rank]  # each rank's grads are its own (a one-rank group)
gen = torch.Generator().manual_seed(rank)
params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(3)]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen)
torch.save([p.grad.clone() for p in params], f"{tmp}/before{rank}.pt")
with megatron_cpu_scope():
    norm = get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=own)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
torch.save([p.grad for p in params], f"{tmp}/after{rank}.pt")
print("clip norm", repr(norm))

from megatron.core.optimizer import optimizer as mo
from megatron_rl.compat import apply_compat, compat_applied
from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed
try:
    init_distributed(ParallelConfig())
    print("init without apply_compat: ok")
except RuntimeError as exc:
    print("init without apply_compat: refused,", "apply_compat()" in str(exc))
load = mo.FP32Optimizer.load_state_dict
assert not compat_applied() and apply_compat() and apply_compat() and compat_applied()
fixed = mo.FP32Optimizer.load_state_dict  # wraps Megatron's own, once
print("fixes patched once:", fixed is not load, any(c.cell_contents is load for c in fixed.__closure__))
moe("after")
print("init after:", init_distributed(ParallelConfig()).world_size)
destroy_distributed()
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The FRESH interpreters' output lines (per rank) and their directory."""
    tmp = tmp_path_factory.mktemp("fresh")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(FRESH), str(tmp), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [o.splitlines() for o, _ in outs], tmp


def test_fresh_process_needs_shim_and_apply_is_idempotent(fresh):
    for out in fresh[0]:
        assert "cuda before: fails" in out  # the patching is really needed on this machine
        assert "global modes added: 0" in out  # the device mode is scoped, never left on
        assert "in scope: cpu" in out
        assert "schedules: cpu" in out
        assert "init without apply_compat: refused, True" in out
        assert "fixes patched once: True True" in out
        assert "init after: 2" in out


def test_moe_shims_needed_and_exact(fresh):
    """Megatron's MoE router and alltoall token dispatcher fail on this machine without the shims,
    and with them compute what plain torch does: before ``apply_compat``, the router's linear raises
    a NameError (``te_general_gemm`` is never bound without Transformer Engine), the dispatcher
    cannot make its CUDA side stream, its split sizes stay tensors (which gloo's all-to-all
    refuses), and the expert-TP gather of uneven token counts fails on gloo; after, the router's
    linear equals ``x @ w.T`` (forward and backward), the dispatcher is built, the split sizes come
    back as numpy arrays and the uneven gather equals the concatenation of both ranks' pieces. The
    whole path (EP and expert TP over gloo) is checked against transformers in
    tests/integration/models/test_moe_parallel.py."""
    for out in fresh[0]:
        assert "moe before router: fails NameError" in out
        assert "moe before dispatcher: fails RuntimeError" in out  # torch.cuda.Stream needs CUDA
        assert "moe before splits: Tensor" in out
        assert "moe before uneven: gather fails RuntimeError" in out, out
        assert "moe after router: True" in out
        assert "moe after dispatcher: ndarray" in out
        assert "moe after splits: ndarray" in out
        assert "moe after uneven: gather True" in out


def test_noop_when_cuda_is_available():
    out = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        before = (torch.cuda.current_device, torch.cuda.manual_seed, torch.cuda.get_rng_state)
        depth = torch._C._len_torch_function_stack()
        from megatron_rl.compat import apply_cpu_shim, cpu_shim_active, megatron_cpu_scope
        print("applied:", apply_cpu_shim(), cpu_shim_active())
        after = (torch.cuda.current_device, torch.cuda.manual_seed, torch.cuda.get_rng_state)
        print("unchanged:", before == after and torch._C._len_torch_function_stack() == depth)
    """)
    assert "applied: False False" in out
    assert "unchanged: True" in out


def test_cuda_placements_land_on_cpu_inside_the_scope():
    assert apply_cpu_shim()
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    x = torch.arange(4.0)
    with megatron_cpu_scope():
        for device in ("cuda", "cuda:0", torch.device("cuda"), 0):
            assert torch.zeros(2, device=device).device.type == "cpu"
            assert torch.tensor([1.0], device=device).device.type == "cpu"
            assert x.to(device).device.type == "cpu"
            assert x.to(device=device).device.type == "cpu"
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.type(torch.float64).dtype == torch.float64  # the converting form is untouched
        assert x.to(torch.float64).dtype == torch.float64
        assert torch.zeros(2, device="meta").device.type == "meta"
    assert x.type() == "torch.FloatTensor"  # nothing leaks out of the scope


def test_backward_functions_are_covered_too():
    assert apply_cpu_shim()

    class Double(torch.autograd.Function):  # like Megatron's gathers: buffers on the "GPU"
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            out = torch.empty(grad.shape, device=torch.cuda.current_device())
            return torch.mul(grad, 2, out=out)

    for run in (lambda y: y.backward(), lambda y: torch.autograd.backward([y]),
                lambda y: torch.autograd.grad(y, [x])):
        x = torch.ones(3, requires_grad=True)
        grads = run(Double.apply(x).sum())
        got = grads[0] if grads is not None else x.grad
        assert torch.equal(got, torch.full((3,), 2.0))


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    assert apply_cpu_shim()
    tracker = mrandom.CudaRNGStatesTracker()
    torch.manual_seed(1234)
    tracker.add("model-parallel-rng", 77)
    inside = []
    with tracker.fork("model-parallel-rng"):
        inside.append(torch.rand(3))
    outside = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        inside.append(torch.rand(3))  # continues the forked stream

    torch.manual_seed(1234)
    ref_outside = torch.rand(3)  # forking and adding leave the default stream where it was
    gen = torch.Generator().manual_seed(77)
    ref_inside = torch.rand(6, generator=gen)
    assert torch.equal(outside, ref_outside)
    assert torch.equal(torch.cat(inside), ref_inside)


def test_megatron_clip_grads_on_cpu_matches_float64(fresh):
    # Megatron's clipping all-reduces over a process group: a one-rank gloo world in FRESH.
    outs, tmp = fresh
    for rank, out in enumerate(outs):  # each over a one-rank group: its own gradients only
        (line,) = [x for x in out if x.startswith("clip norm ")]
        _check_clipped(float(line.split()[-1]), [g.double() for g in torch.load(tmp / f"before{rank}.pt")],
                       torch.load(tmp / f"after{rank}.pt"))


def _check_clipped(norm, before, after):
    ref_norm = math.sqrt(sum(float((g * g).sum()) for g in before))
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    coeff = 1.0 / (ref_norm + 1e-6)
    assert coeff < 1.0  # clipping really happened
    for got, g in zip(after, before):
        torch.testing.assert_close(got.double(), g * coeff, rtol=1e-6, atol=1e-7)


def test_context_parallel_rotary_slice_runs_on_the_cpu(fresh):
    """Megatron's per-CP-rank rotary slice makes a pinned index tensor and moves it with .cuda():
    it fails without the shim and, with it, picks chunks (r, 2·CP-1-r) as on a GPU."""
    out = fresh[0][0]
    assert "rotary before: fails" in out
    assert out.count("rotary after: [2.0, 3.0, 4.0, 5.0]") == 2  # rank 1 of 2: chunks 1 and 2 (lines)
    assert "rotary modes left: 0" in out
