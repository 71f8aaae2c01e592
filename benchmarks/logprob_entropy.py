"""Fused log-prob + entropy vs the naive PyTorch way vs the bare output-layer matmuls.

Prints, for each size, forward+backward and forward-only time of

- ``ours``   megatron_rl.ops.fused_logprob_entropy (back-end per --backend),
- ``naive``  materialised logits -> log_softmax -> gather + entropy, autograd backward,
- ``floor``  the output layer's three GEMMs alone (h @ W^T, then dz @ W and dz^T @ h with a stand-in
             dz of the logits' shape): no softmax at all, the time any method must pay,
- peers on CUDA when importable (``--peers``): Liger-Kernel's fused linear cross-entropy (log-prob
  only, no temperature or entropy) and verl's ``linear_cross_entropy`` (log-prob + entropy),

and the peak memory of one forward+backward of ``ours`` and ``naive`` (and the peers), over what the
inputs already hold (the gradients produced are counted, for everybody).

Memory method. CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
the allocated bytes before the call. CPU: PyTorch has no allocator statistics on CPU and tracemalloc
does not see its buffers, so every CPU measurement runs in a fresh subprocess: build the inputs,
read ``VmRSS``, reset the kernel's resident high-water mark (write ``5`` to ``/proc/self/clear_refs``),
run one forward+backward, read ``VmHWM``; the difference is the peak resident memory the call added.
A fresh process keeps memory that earlier variants freed (and glibc kept) out of the number; a call
at the tiny size first takes one-time set-up (thread pools, lazily loaded code) out of it, and
``MALLOC_MMAP_THRESHOLD_`` makes glibc hand freed blocks straight back.

Times are the minimum over ``--repeats`` interleaved rounds (the CPU box is shared; the minimum is the
least disturbed run). Ratios are taken within this one run.

    python benchmarks/logprob_entropy.py                    # CPU, small + big (big takes minutes)
    python benchmarks/logprob_entropy.py --sizes small
    python benchmarks/logprob_entropy.py --device cuda --backend triton --dtype bf16 --peers
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # the repo root

SIZES = {  # name: (N tokens, H hidden, V vocabulary); "tiny" is a smoke test
    "tiny": (256, 64, 2048),
    "small": (1024, 512, 32768),
    "big": (4096, 1024, 151936),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEMPERATURE = 0.9


def make_inputs(size, dtype, device, seed=0):
    n, h, v = SIZES[size]
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(device).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    g_logp = torch.randn(n, generator=g).to(device)
    g_ent = torch.randn(n, generator=g).to(device)
    return hidden, weight, labels, g_logp, g_ent


# ----------------------------------------------------------------------------- variants
def ours(inp, backend, grad=True):
    from megatron_rl.ops import fused_logprob_entropy

    hidden, weight, labels, g_logp, g_ent = inp
    logp, ent = fused_logprob_entropy(hidden, weight, labels, temperature=TEMPERATURE,
                                      backend=backend)
    if grad:
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()


def naive(inp, backend, grad=True):
    hidden, weight, labels, g_logp, g_ent = inp
    logits = (hidden @ weight.t()).float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    if grad:
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()


def floor(inp, backend, grad=True):
    hidden, weight = inp[0].detach(), inp[1].detach()
    z = hidden @ weight.t()
    if grad:  # the two backward GEMMs, with z standing in for dL/dz (same shapes, same flops)
        torch.mm(z, weight)
        torch.mm(z.t(), hidden)


def liger(inp, backend, grad=True):
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)

    hidden, weight, labels, _, _ = inp
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, labels)
    if grad:
        loss.backward()


def _verl_linear_cross_entropy():
    """verl's kernel module without running ``verl/__init__.py`` (which imports ray, tensordict
    and more that a bare GPU machine lacks): stand-in packages point at the unpacked wheel."""
    import importlib
    import importlib.util
    import types

    name = "verl.utils.kernel.linear_cross_entropy"
    if name in sys.modules:
        return sys.modules[name].linear_cross_entropy
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not on sys.path (run benchmarks/gpu/fetch_peer_wheels.sh)")
    root = list(spec.submodule_search_locations)[0]
    for pkg, sub in (("verl", ""), ("verl.utils", "/utils"), ("verl.utils.kernel", "/utils/kernel")):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [root + sub]
            sys.modules[pkg] = mod
    return importlib.import_module(name).linear_cross_entropy


def verl(inp, backend, grad=True):
    linear_cross_entropy = _verl_linear_cross_entropy()
    hidden, weight, labels, g_logp, g_ent = inp
    logp, ent = linear_cross_entropy(hidden, weight, labels, TEMPERATURE, "none", None)
    if grad:
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()


VARIANTS = {"ours": ours, "naive": naive, "floor": floor, "liger": liger, "verl": verl}


# ----------------------------------------------------------------------------- measuring
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_once(fn, inp, backend, device, grad):
    """(wall seconds, process CPU seconds) of one call."""
    inp[0].grad = inp[1].grad = None
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    if grad:
        fn(inp, backend, grad=True)
    else:
        with torch.no_grad():
            fn(inp, backend, grad=False)
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_here(variant, size, dtype, device, backend):
    """Peak bytes one forward+backward adds over the inputs (run in a fresh process on CPU)."""
    inp = make_inputs(size, DTYPES[dtype], device)
    fn = VARIANTS[variant]
    if device == "cuda":
        fn(inp, backend)  # compile / autotune first, then measure a clean call
        inp[0].grad = inp[1].grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(inp, backend)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    fn(make_inputs("tiny", DTYPES[dtype], device), backend)  # one-time code-path setup, small
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    fn(inp, backend)
    return (_status_kib("VmHWM") - base) * 1024


def peak_memory(variant, size, args):
    if args.device == "cuda":
        return peak_memory_here(variant, size, args.dtype, args.device, args.backend)
    cmd = [sys.executable, __file__, "--_mem-child", variant, "--sizes", size, "--dtype", args.dtype,
           "--backend", args.backend, "--device", args.device]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    # large blocks via mmap, so what the set-up call freed goes back to the system at once
    env = dict(__import__("os").environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory child {variant}/{size} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def available(name, device):
    if name in ("ours", "naive", "floor"):
        return None
    if device != "cuda":
        return "needs CUDA"
    try:
        if name == "liger":
            import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401
        else:
            _verl_linear_cross_entropy()
    except Exception as exc:  # noqa: BLE001 - report why a peer is missing, keep benchmarking
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return None


def bench_size(size, args):
    names = ["floor", "ours", "naive"] + (["liger", "verl"] if args.peers else [])
    missing = {n: why for n in names if (why := available(n, args.device))}
    names = [n for n in names if n not in missing]
    inp = make_inputs(size, DTYPES[args.dtype], args.device)
    # best (wall, cpu) per variant, forward+backward and forward only
    fb = {n: (float("inf"), float("inf")) for n in names}
    fwd = {n: (float("inf"), float("inf")) for n in names}
    for n in list(names if args.device == "cuda" else []):  # compile Triton kernels, autotune
        try:
            run_once(VARIANTS[n], inp, args.backend, args.device, grad=True)
        except Exception as exc:  # noqa: BLE001 - a broken variant must not hide the others
            if n in ("floor", "ours"):
                raise
            missing[n] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            names.remove(n)
    for _ in range(args.repeats if args.measure in ("all", "time") else 0):
        for n in names:
            for table, grad in ((fb, True), (fwd, False)):
                wall, cpu = run_once(VARIANTS[n], inp, args.backend, args.device, grad=grad)
                table[n] = (min(table[n][0], wall), min(table[n][1], cpu))
    del inp
    mem = {n: peak_memory(n, size, args) for n in names
           if n != "floor" and args.measure in ("all", "mem")}
    n_tok, hid, voc = SIZES[size]
    print(f"\n## {size}: N={n_tok} H={hid} V={voc} dtype={args.dtype} device={args.device} "
          f"backend={args.backend} T={TEMPERATURE} repeats={args.repeats} "
          f"threads={torch.get_num_threads()} load={_loadavg()}")
    cols = [("fwd+bwd", fb, 0), ("fwd", fwd, 0)]
    if args.device == "cpu":  # CPU seconds: the work done, less disturbed by other processes
        cols = [("fwd+bwd", fb, 0), ("fwd+bwd cpu", fb, 1), ("fwd", fwd, 0), ("fwd cpu", fwd, 1)]
    print(f"{'variant':8}" + "".join(f" {c + ' s':>14} {'x floor':>7}" for c, _, _ in cols)
          + f" {'peak MiB':>9} {'naive/this':>10}")
    for n in names:
        row = "".join(f" {t[n][i]:14.3f} {t[n][i] / t['floor'][i]:7.2f}" if args.repeats and
                      args.measure != "mem" else f" {'-':>14} {'-':>7}" for _, t, i in cols)
        m = mem.get(n)
        peak = f"{m / 2**20:9.1f}" if m is not None else f"{'-':>9}"
        ratio = f"{mem['naive'] / m:10.1f}" if m and "naive" in mem else f"{'-':>10}"
        print(f"{n:8}{row} {peak} {ratio}")
    for n, why in missing.items():
        print(f"{n:8} not run: {why}")
    sys.stdout.flush()


def _loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="small,big")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", default="auto", help="auto | torch | triton")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peers", action="store_true", help="also Liger-Kernel and verl (CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--measure", choices=["all", "time", "mem"], default="all")
    ap.add_argument("--_mem-child", dest="mem_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_child:
        peak = peak_memory_here(args.mem_child, args.sizes, args.dtype, args.device, args.backend)
        print(json.dumps({"peak_bytes": peak}))
        return
    for size in args.sizes.split(","):
        bench_size(size, args)


if __name__ == "__main__":
    main()
