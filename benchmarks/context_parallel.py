"""Long sequences on the policy: memory-efficient attention and context parallelism, on the tiny model.

Prints, in one run:

1. core attention, one forward + backward at S = ``--attn-seq`` (4096) with the tiny model's heads:
   peak memory and time of ours (``SDPAttention``, torch's fused kernel) vs Megatron's
   ``DotProductAttention`` (the local spec's, which forms the ``[b, heads, S, S]`` scores), and the
   physical floor (what q, k, v, the output and their gradients hold: nothing can need less);
2. one training step of the whole policy on ONE long sequence (``--seq``, default 8192 tokens, of
   which ``--prompt`` are prompt) under ``torchrun --nproc-per-node 2``: at CP = 1 (the two ranks
   are data-parallel; the sequence sits on one of them) and at CP = 2 (the sequence split over
   both): peak activation memory per rank, step time, and the log-probs of the two layouts
   compared (``max_abs_logprob_diff``). The ideal CP = 2 / CP = 1 memory ratio is 0.5.

Memory method: every number is the peak of the bytes the CPU allocator holds during the measured
call over what it held at the call's start, taken from the PyTorch profiler's allocation events
(``profile_memory=True``: each allocation and free, in order; the running sum's maximum). It counts
tensors only (no interpreter, no allocator slack), so it is exact and repeatable. For the policy the
measured call is the second ``train_step`` (the first allocates Adam's state), so the peak is the
step's activations, gradient buffers' temporaries and the optimizer's scratch.

Times are wall-clock on a shared 2-core machine: the load average is printed beside them; the
memory ratios do not depend on it.

    python benchmarks/context_parallel.py                 # ~2-4 min on 2 cores
    python benchmarks/context_parallel.py --seq 4096      # quicker

The last line is one JSON object: ``attention_memory_ratio`` (ours / DotProductAttention, target
<= 0.25), ``activation_memory_ratio`` (CP=2 per rank / CP=1, target <= 0.6), ``max_abs_logprob_diff``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def peak_bytes(fn) -> tuple[int, object]:
    """(peak bytes the CPU allocator held during ``fn()`` over its start, fn's result)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


# ------------------------------------------------------------------------------------------------
# 1. core attention


def peak_bytes_on(device: str, fn) -> tuple[int, object]:
    """:func:`peak_bytes` on the CPU; on CUDA from the allocator's own high-water mark."""
    if device == "cpu":
        return peak_bytes(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result


def attention_part(seq: int, repeats: int, device: str = "cpu", dtype=torch.float32) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.compat import megatron_cpu_scope
    from megatron_rl.demo.config import TinySpec
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.models.attention import SDPAttention

    tiny = TinySpec()
    heads, groups, head_dim = tiny.num_heads, tiny.num_kv_heads, tiny.hidden_size // tiny.num_heads
    init_distributed(ParallelConfig())
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    config = TransformerConfig(num_layers=1, hidden_size=tiny.hidden_size, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim,
                               use_cpu_initialization=True, attention_dropout=0.0,
                               hidden_dropout=0.0, bf16=dtype == torch.bfloat16,
                               params_dtype=dtype)
    args = (config, 1, AttnMaskType.causal, "self")
    modules = {"ours": SDPAttention(*args, pg_collection=pg),
               "dot_product_attention": DotProductAttention(*args, pg_collection=pg)}
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for shape in
                     ((seq, 1, heads, head_dim), (seq, 1, groups, head_dim),
                      (seq, 1, groups, head_dim), (seq, 1, heads * head_dim)))

    def step(module):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with megatron_cpu_scope():
            out = module(qq, kk, vv, None)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    res = {}
    outputs = {}
    for name, module in modules.items():
        step(module)  # warm-up: kernels, thread pools, workspaces
        peak, outputs[name] = peak_bytes_on(device, lambda m=module: step(m))
        times = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(module)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res[name] = {"peak_bytes": peak, "time_s": min(times)}
    destroy_distributed()
    # the inputs' gradients, the output and its gradient
    floor = 2 * sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs["ours"],
                                                           outputs["dot_product_attention"]))
    return {"seq": seq, "heads": heads, "kv_heads": groups, "head_dim": head_dim, **res,
            "floor_bytes": floor, "max_abs_diff": diff}


# ------------------------------------------------------------------------------------------------
# 2. the policy on one long sequence, CP = 1 vs CP = 2 (torchrun worker)


def worker(args) -> None:
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import (OptimConfig, ParallelConfig, PolicyConfig, SequenceBatch,
                                    destroy_distributed, init_distributed)
    from megatron_rl.models.policy import MegatronPolicy

    apply_compat()
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 40, (args.seq,), generator=g).tolist()
    n = args.seq - args.prompt
    batch = SequenceBatch(sequences=[seq], prompt_lens=[args.prompt],
                          token_fields={"adv": [torch.randn(n, generator=g)]})

    def loss_fn(mb):
        m = mb.mask.to(mb.logp.dtype)
        loss = -(mb.fields["adv"] * mb.logp * m).sum() / n - 0.01 * (mb.entropy * m).sum() / n
        return loss, {"loss": loss.item()}

    results = {}
    for cp in (1, 2):
        par = ParallelConfig(context_parallel=cp, timeout_s=600)
        cfg = PolicyConfig(parallel=par, micro_batch_tokens=args.seq,
                           optim=OptimConfig(lr=1e-4, clip_grad=0.0))
        groups = init_distributed(par)
        policy = MegatronPolicy.from_hf(args.hf, cfg, groups)
        logps, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False)
        policy.train_step(batch, loss_fn, 1.0, with_entropy=True)  # allocates Adam's state
        t0 = time.perf_counter()
        peak, _ = peak_bytes(lambda: policy.train_step(batch, loss_fn, 1.0, with_entropy=True))
        elapsed = time.perf_counter() - t0
        peaks = [None] * groups.world_size
        torch.distributed.all_gather_object(peaks, peak)
        results[cp] = {"peak_bytes_per_rank": peaks, "step_time_s": elapsed, "logps": logps[0]}
        del policy  # the next init_distributed rebuilds Megatron's groups in the same world
    if int(os.environ.get("RANK", "0")) == 0:
        diff = float((results[1]["logps"] - results[2]["logps"]).abs().max())
        out = {f"cp{cp}": {k: v for k, v in r.items() if k != "logps"}
               for cp, r in results.items()}
        out["max_abs_logprob_diff"] = diff
        Path(args.out).write_text(json.dumps(out))
    destroy_distributed()


def policy_part(args) -> dict:
    from megatron_rl.demo.config import TinySpec
    from megatron_rl.demo.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="cp_bench_") as tmp:
        hf = write_tiny_model(Path(tmp) / "tiny",
                              TinySpec(seed=0, max_position_embeddings=args.seq))
        out = Path(tmp) / "result.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), __file__, "--worker",
               "--hf", str(hf), "--out", str(out), "--seq", str(args.seq),
               "--prompt", str(args.prompt)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                             if p)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"torchrun failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attn-seq", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention-only", action="store_true", help="part 1 only")
    ap.add_argument("--device", default="cpu", help="part 1's device (cpu or cuda)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="part 1's dtype")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from megatron_rl.compat import apply_compat

    apply_compat()
    mib = lambda b: f"{b / 2**20:9.1f} MiB"  # noqa: E731
    print(f"load average before: {loadavg()} (shared 2-core machine; times are upper bounds)")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    attn = attention_part(args.attn_seq, args.repeats, args.device, dtype)
    print(f"\n1. core attention, S={attn['seq']}, heads {attn['heads']} (kv {attn['kv_heads']}), "
          f"head_dim {attn['head_dim']}, {args.dtype} on {args.device}, forward + backward")
    for name in ("ours", "dot_product_attention"):
        r = attn[name]
        print(f"   {name:22s} peak {mib(r['peak_bytes'])}   time {r['time_s'] * 1e3:8.1f} ms")
    print(f"   {'floor (q,k,v,out+grads)':22s} peak {mib(attn['floor_bytes'])}")
    attn_ratio = attn["ours"]["peak_bytes"] / attn["dot_product_attention"]["peak_bytes"]
    print(f"   ours / DotProductAttention memory {attn_ratio:.4f}  (target <= 0.25), "
          f"ours / floor {attn['ours']['peak_bytes'] / attn['floor_bytes']:.2f}, "
          f"time ratio {attn['ours']['time_s'] / attn['dot_product_attention']['time_s']:.2f}, "
          f"max |diff| {attn['max_abs_diff']:.1e}")
    if args.attention_only:
        print(json.dumps({"attention_memory_ratio": round(attn_ratio, 5),
                          "attention_time_ratio": round(attn["ours"]["time_s"]
                                                        / attn["dot_product_attention"]["time_s"], 3),
                          "max_abs_diff": attn["max_abs_diff"], "load_average": float(loadavg())}))
        return

    pol = policy_part(args)
    cp1 = max(pol["cp1"]["peak_bytes_per_rank"])
    cp2 = max(pol["cp2"]["peak_bytes_per_rank"])
    act_ratio = cp2 / cp1
    print(f"\n2. policy train_step, one sequence of {args.seq} tokens ({args.prompt} prompt), "
          f"tiny model, 2 ranks")
    for cp in (1, 2):
        r = pol[f"cp{cp}"]
        peaks = ", ".join(mib(p).strip() for p in r["peak_bytes_per_rank"])
        print(f"   CP={cp}: peak per rank [{peaks}]   step {r['step_time_s']:.2f} s")
    print(f"   CP=2 / CP=1 peak activation memory per rank {act_ratio:.3f}  (ideal 0.5, target "
          f"<= 0.6); step time ratio {pol['cp2']['step_time_s'] / pol['cp1']['step_time_s']:.2f}; "
          f"log-probs CP=2 vs CP=1 max |diff| {pol['max_abs_logprob_diff']:.1e}")
    print(f"load average after: {loadavg()}")
    print(json.dumps({"attention_memory_ratio": round(attn_ratio, 5),
                      "activation_memory_ratio": round(act_ratio, 4),
                      "max_abs_logprob_diff": pol["max_abs_logprob_diff"],
                      "attention_time_ratio": round(attn["ours"]["time_s"]
                                                    / attn["dot_product_attention"]["time_s"], 3),
                      "cp2_step_time_s": round(pol["cp2"]["step_time_s"], 3),
                      "cp1_step_time_s": round(pol["cp1"]["step_time_s"], 3),
                      "load_average": float(loadavg())}))


if __name__ == "__main__":
    main()
