"""The CPU shim: Megatron's CUDA-only spots run on the CPU, and nothing changes when CUDA exists.

The shim patches process-wide state, so the before/after checks run in fresh interpreters; the
behaviour checks (gradient clipping, the RNG tracker) run here against float64 / plain-torch
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


# One fresh interpreter for every check that needs one (a Megatron import costs seconds): it
# prints one labelled line per fact, in this order, and each test below reads its own lines.
#   1. before the shim: a CUDA tensor, and Megatron's per-CP-rank rotary slice, fail on this machine;
#   2. the shim applied (twice): scoped device mode, Megatron's schedules module, the rotary slice;
#   3. Megatron's gradient clipping in a one-rank gloo world (the tensors saved for a float64 check);
#   4. init_distributed refuses before compat.apply_compat(), which adds the Megatron fixes once.
FRESH = """
import sys
import torch
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

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
tmp = sys.argv[1]
store = torch.distributed.FileStore(tmp + "/store", 1)
torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(3)]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen)
torch.save([p.grad.clone() for p in params], tmp + "/before.pt")
with megatron_cpu_scope():
    norm = get_grad_norm_fp32([p.grad for p in params])
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
torch.save([p.grad for p in params], tmp + "/after.pt")
print("clip norm", repr(norm))
torch.distributed.destroy_process_group()

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
print("init after:", init_distributed(ParallelConfig()).world_size)
destroy_distributed()
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The FRESH interpreter's output lines and its directory."""
    tmp = tmp_path_factory.mktemp("fresh")
    return _run(FRESH, str(tmp)).splitlines(), tmp


def test_fresh_process_needs_shim_and_apply_is_idempotent(fresh):
    out, _ = fresh
    assert "cuda before: fails" in out  # the patching is really needed on this machine
    assert "global modes added: 0" in out  # the device mode is scoped, never left on
    assert "in scope: cpu" in out
    assert "schedules: cpu" in out
    assert "init without apply_compat: refused, True" in out
    assert "fixes patched once: True True" in out
    assert "init after: 1" in out


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
    out, tmp = fresh
    (line,) = [x for x in out if x.startswith("clip norm ")]
    norm = float(line.split()[-1])
    before = [g.double() for g in torch.load(tmp / "before.pt")]
    after = torch.load(tmp / "after.pt")
    ref_norm = math.sqrt(sum(float((g * g).sum()) for g in before))
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    coeff = 1.0 / (ref_norm + 1e-6)
    assert coeff < 1.0  # clipping really happened
    for got, g in zip(after, before):
        torch.testing.assert_close(got.double(), g * coeff, rtol=1e-6, atol=1e-7)


def test_context_parallel_rotary_slice_runs_on_the_cpu(fresh):
    """Megatron's per-CP-rank rotary slice makes a pinned index tensor and moves it with .cuda():
    it fails without the shim and, with it, picks chunks (r, 2·CP-1-r) as on a GPU."""
    out, _ = fresh
    assert "rotary before: fails" in out
    assert out.count("rotary after: [2.0, 3.0, 4.0, 5.0]") == 2  # rank 1 of 2: chunks 1 and 2 (lines)
    assert "rotary modes left: 0" in out
