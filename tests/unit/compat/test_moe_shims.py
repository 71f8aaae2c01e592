"""The Mixture-of-Experts shims: Megatron's MoE router and alltoall token dispatcher fail on this
machine without them, and with them compute what plain torch does.

In two fresh interpreters, a two-rank gloo world (the shims patch process-wide state): before
``apply_compat``, the router's linear raises a NameError (``te_general_gemm`` is never bound without
Transformer Engine), the dispatcher cannot make its CUDA side stream, its split sizes stay tensors
(which gloo's all-to-all refuses), and the expert-TP gather of uneven token counts fails on
gloo; after, the router's linear equals ``x @ w.T`` (forward and backward), the dispatcher is built,
the split sizes come back as numpy arrays and the uneven gather equals the concatenation of both
ranks' pieces. The whole path (EP and expert TP over gloo) is checked
against transformers in tests/integration/models/test_moe_parallel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are inactive with CUDA")

REPO = Path(__file__).resolve().parents[3]

FRESH = """
import sys
import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils, token_dispatcher

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
    from megatron.core import parallel_state as ps
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
    torch.cuda.current_device = lambda: torch.device("cpu")  # (the CPU shim's; not what is checked)
    rank = dist.get_rank()
    sizes = [3, 1]
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 10 * rank
    full = torch.cat([torch.arange(n * 2, dtype=torch.float64).reshape(-1, 2) + 10 * r
                      for r, n in enumerate(sizes)])
    out = []
    for name, fn in (("gather", lambda: torch.equal(
                         mappings._gather_along_first_dim(mine, dist.group.WORLD, sizes), full)),):
        try:
            out.append(f"{name} {fn()}")
        except Exception as exc:
            out.append(f"{name} fails {type(exc).__name__}")
    return ", ".join(out)

rank = int(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + "/store", 2), rank=rank, world_size=2)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel()
for phase in ("before", "after"):
    if phase == "after":
        from megatron_rl.compat import apply_compat
        apply_compat()
        apply_compat()
    for name, fn in (("router", router_linear), ("dispatcher", dispatcher), ("uneven", uneven)):
        try:
            print(f"{phase} {name}:", fn())
        except Exception as exc:
            print(f"{phase} {name}: fails {type(exc).__name__}")
    print(f"{phase} splits:", type(token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)).__name__)
    dist.barrier()
"""


def test_moe_shims_needed_and_exact(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(FRESH), str(tmp_path), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for out in (o.splitlines() for o, _ in outs):
        assert "before router: fails NameError" in out
        assert "before dispatcher: fails RuntimeError" in out  # torch.cuda.Stream needs CUDA
        assert "before splits: Tensor" in out
        assert "before uneven: gather fails RuntimeError" in out, out
        assert "after router: True" in out
        assert "after dispatcher: ndarray" in out
        assert "after splits: ndarray" in out
        assert "after uneven: gather True" in out
