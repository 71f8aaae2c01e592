"""Weight-sync throughput: our bucketed broadcast vs one raw broadcast (the floor) vs per-tensor.

One run prints, for a synthetic transformer of a few hundred MB with many tensors, the time of

* ``floor``      one broadcast of a single tensor holding all the bytes (the transport's best),
* ``per-tensor`` one blocking broadcast per tensor (OpenRLHF-style baseline),
* ``ours``       ``megatron_rl.sync.collective.send_all`` + the engine-side receive/unpack, with and
                 without checksums, and a bucket-size sweep,

as ratios measured in this run. Every trial ends with a barrier, so times include the receivers.
Receivers stop at unpacked tensors (no vLLM load), so the numbers are the transport's.

    python benchmarks/weight_sync.py                     # CPU, gloo, 2 receivers
    python benchmarks/weight_sync.py --backend nccl      # one GPU per process (>= 3 GPUs)
    python benchmarks/weight_sync.py --backend ipc       # colocated: CUDA IPC (GPU) / shm (CPU)

In ``ipc`` mode one engine process shares the trainer's device (NCCL refuses two processes on one
GPU); ``ours`` is the real ``CudaIpcWeightSync`` driving a RemoteEngine whose worker drains the
loader's iterator, the floor is one handle to one flat buffer copied out once, and the per-tensor
baseline sends one handle per tensor (on CPU each tensor is first staged into its own segment).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without an install
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.remote import RemoteEngine  # noqa: E402
from megatron_rl.sync.buckets import checksums, unpack  # noqa: E402
from megatron_rl.sync.collective import send_all  # noqa: E402
from megatron_rl.sync.config import SyncConfig  # noqa: E402
from megatron_rl.sync.cuda_ipc import CudaIpcWeightSync, SharedBuffer, open_shared  # noqa: E402
from megatron_rl.sync.group import broadcast, host_store, make_group, recv_buckets  # noqa: E402

MiB = 1024 * 1024


def synthetic_model(layers: int, hidden: int, inter: int, vocab: int, dtype: torch.dtype,
                    device: torch.device = torch.device("cpu")):
    """HF-named tensors of a Qwen2-like model (q/k/v biases: many small tensors too)."""
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    out = [("model.embed_tokens.weight", t(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", t(hidden)),
                (p + "self_attn.q_proj.weight", t(hidden, hidden)), (p + "self_attn.q_proj.bias", t(hidden)),
                (p + "self_attn.k_proj.weight", t(hidden, hidden)), (p + "self_attn.k_proj.bias", t(hidden)),
                (p + "self_attn.v_proj.weight", t(hidden, hidden)), (p + "self_attn.v_proj.bias", t(hidden)),
                (p + "self_attn.o_proj.weight", t(hidden, hidden)),
                (p + "post_attention_layernorm.weight", t(hidden)),
                (p + "mlp.gate_proj.weight", t(inter, hidden)), (p + "mlp.up_proj.weight", t(inter, hidden)),
                (p + "mlp.down_proj.weight", t(hidden, inter))]
    out += [("model.norm.weight", t(hidden)), ("lm_head.weight", t(vocab, hidden))]
    return out


def plan(args, shapes):
    """The trial list every rank walks in the same order: (kind, bucket_bytes, verify)."""
    trials = []
    for _ in range(args.repeats):
        trials += [("floor", 0, False), ("per_tensor", 0, False),
                   ("ours", args.bucket_mib * MiB, False), ("ours", args.bucket_mib * MiB, True)]
        trials += [("ours", b * MiB, False) for b in args.sweep_mib]
    return trials


def _device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def receiver(rank: int, args, port: int, shapes):
    os.environ["OMP_NUM_THREADS"] = "1"
    device = _device(args.backend, rank)
    group = make_group(args.backend, "127.0.0.1", port, rank, args.receivers + 1, 300.0)
    total = sum(s.numel() * s.element_size() for _, s in shapes)
    for kind, _bucket, verify in plan(args, shapes):
        if kind == "floor":
            broadcast(group, torch.empty(total, dtype=torch.uint8, device=device)).wait()
        elif kind == "per_tensor":
            for _, s in shapes:
                broadcast(group, torch.empty(3, dtype=torch.int64, device=device)).wait()
                broadcast(group, torch.empty(s.shape, dtype=s.dtype, device=device)).wait()
        else:
            for meta, data in recv_buckets(group, device, 300.0):
                tensors = unpack(meta, data)  # what the engine side does per bucket
                if verify:
                    checksums(tensors)
        group.barrier().wait()


def sender(args, named, device):
    group = None
    world = args.receivers + 1
    store = host_store("127.0.0.1", world, 300.0)
    shapes = [(n, torch.empty(0, dtype=t.dtype).new_empty(t.shape, device="meta")) for n, t in named]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receiver, args=(r, args, store.port, shapes)) for r in range(1, world)]
    for p in procs:
        p.start()
    group = make_group(args.backend, "127.0.0.1", store.port, 0, world, 300.0, store=store)
    named = [(n, t.to(device)) for n, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    buffers = {}
    times: dict[tuple, list[float]] = {}
    for kind, bucket, verify in plan(args, shapes):
        if kind == "ours" and bucket not in buffers:
            buffers[bucket] = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(2)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if kind == "floor":
            broadcast(group, flat).wait()
        elif kind == "per_tensor":
            for i, (_, t) in enumerate(named):  # a small header (index, numel, dtype) then the tensor
                broadcast(group, torch.tensor([i, t.numel(), 0], device=device)).wait()
                broadcast(group, t).wait()
        else:
            send_all(group, iter(named), buffers[bucket], device, verify, 300.0)
        group.barrier().wait()
        times.setdefault((kind, bucket, verify), []).append(time.perf_counter() - t0)
    for p in procs:
        p.join(timeout=60)
    return {k: statistics.median(v) for k, v in times.items()}, total


# --------------------------------------------------------------------- colocated (IPC) mode
class _DrainWorker:
    """Stands in for a vLLM worker: consumes exactly what the weight loader would be given."""

    rank = 0

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        for _ in weights_iterator:
            pass


class _BareEngine:
    """The engine-process side without vLLM: runs collective_rpc functions on a drain worker."""

    def __init__(self):
        self.llm, self.worker, self.weight_version = self, _DrainWorker(), 0

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        pass

    def close(self):
        pass


def bare_engine(model_path, cfg, **kwargs):
    return _BareEngine()


def _rep_socket(endpoint: str):
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def ipc_receive_each(worker, endpoint: str, count: int) -> int:
    """Baselines' engine side: ``count`` times map a handle, copy the tensor out, acknowledge."""
    sock = _rep_socket(endpoint)
    for _ in range(count):
        tensor, keep = open_shared(__import__("pickle").loads(sock.recv()))
        copy = tensor.clone()
        if copy.is_cuda:
            torch.cuda.current_stream().synchronize()
        del tensor, copy
        if keep is not None:
            keep.close()
        sock.send(b"ok")
    sock.close()
    return count


def run_ipc(args, named, device):
    import pickle
    import tempfile

    import zmq

    cfg = RolloutConfig(kv_cache_bytes=0, timeout_s=300.0)
    engine = RemoteEngine("none", cfg, name="colocated", factory=bare_engine,
                          env={"OMP_NUM_THREADS": "1"})
    named = [(n, t.to(device)) for n, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named)
    flat = SharedBuffer(total, device)
    torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named], out=flat.tensor)  # pre-packed
    tmp = tempfile.mkdtemp(prefix="mrl-bench-")
    times: dict[tuple, list[float]] = {}
    syncs = {}

    def handles(endpoint, payloads):
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        pending = engine.submit("rpc", ipc_receive_each, (endpoint, len(payloads)))
        for make in payloads:
            buf = make()
            sock.send(pickle.dumps(buf.handle))
            sock.recv()
            if buf is not flat:
                buf.close()
        pending.result(300.0)
        sock.close()

    def staged(t):
        def make():
            buf = SharedBuffer(t.numel() * t.element_size(), device)
            buf.tensor.copy_(t.reshape(-1).view(torch.uint8))
            return buf
        return make

    def own(t):  # CUDA: a handle to the tensor itself, no staging copy
        class _Own:
            handle = ("cuda", __import__("torch.multiprocessing.reductions",
                                         fromlist=["reduce_tensor"]).reduce_tensor(t))
        return lambda: _Own

    for trial, (kind, bucket, verify) in enumerate(plan(args, None)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if kind == "floor":
            handles(f"ipc://{tmp}/floor{trial}", [lambda: flat])
        elif kind == "per_tensor":
            handles(f"ipc://{tmp}/pt{trial}",
                    [own(t) if device.type == "cuda" else staged(t) for _, t in named])
        else:
            key = (bucket, verify)
            if key not in syncs:
                syncs[key] = CudaIpcWeightSync(SyncConfig(transport="cuda_ipc", bucket_bytes=bucket,
                                                          verify=verify, timeout_s=300.0), [engine])
                syncs[key].connect()
            syncs[key].sync(iter(named), version=trial)
        times.setdefault((kind, bucket, verify), []).append(time.perf_counter() - t0)
    for sync in syncs.values():
        sync.close()
    flat.close()
    engine.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items()}, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["gloo", "nccl", "ipc"], default="gloo")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--sweep-mib", type=int, nargs="*", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = (args.layers, args.hidden, args.inter, args.vocab, getattr(torch, args.dtype))
    if args.backend == "ipc":
        args.receivers = 1
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        named = synthetic_model(*shape, device=device)
        med, total = run_ipc(args, named, device)
    else:
        device = _device(args.backend, 0)
        named = synthetic_model(*shape)
        med, total = sender(args, named, device)
    floor = med[("floor", 0, False)]
    per_tensor = med[("per_tensor", 0, False)]
    print(f"backend={args.backend} device={device.type} receivers={args.receivers} tensors={len(named)} "
          f"bytes={total / MiB:.1f} MiB repeats={args.repeats} (medians)")
    print(f"{'variant':34s} {'seconds':>8s} {'GB/s':>7s} {'x floor':>8s} {'per-tensor/x':>13s}")

    def row(label, sec):
        print(f"{label:34s} {sec:8.3f} {total / sec / 1e9:7.2f} {sec / floor:8.2f} {per_tensor / sec:13.2f}")

    row("floor: one raw transfer (all bytes)", floor)
    row("per-tensor transfer", per_tensor)
    row(f"ours, {args.bucket_mib} MiB buckets", med[("ours", args.bucket_mib * MiB, False)])
    row(f"ours, {args.bucket_mib} MiB buckets + checksums", med[("ours", args.bucket_mib * MiB, True)])
    for b in args.sweep_mib:
        row(f"  sweep: ours, {b} MiB buckets", med[("ours", b * MiB, False)])


if __name__ == "__main__":
    main()
