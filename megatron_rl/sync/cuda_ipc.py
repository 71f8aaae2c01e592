"""Colocated sync: trainer and engine share a device; buckets travel as IPC handles, not bytes.

On GPUs the trainer packs each bucket into one of two CUDA buffers and sends the engine worker a
CUDA IPC handle for it (``torch.multiprocessing.reductions.reduce_tensor``); the worker maps the
buffer, copies the bucket out (device-to-device), acknowledges, and feeds vLLM's weight loader.
NCCL refuses two processes on one GPU, which is why the colocated path exists. On CPU the same
protocol runs over POSIX shared memory (``multiprocessing.shared_memory``), so it is tested here;
an engine in the trainer's own process gets the tensors directly (no copy at all).

Control messages go over a ZeroMQ REQ/REP socket per engine (``ipc://`` in a temp dir); every
receive polls with ``sync.timeout_s``. Engine sleep/wake: ``sleep_engines()`` frees the KV cache
(GPU) before training; the next ``sync`` wakes the engines before loading.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import uuid
from collections.abc import Sequence

import torch

from megatron_rl.sync import engine_side
from megatron_rl.sync.base import (NamedTensors, SyncError, SyncMetrics, SyncTimeout, WeightSync,
                                   commit, drain, invalidate)
from megatron_rl.sync.buckets import BucketMeta, checksums, group_by_dtype, pack, unpack
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.inprocess import InProcessWeightSync

_END = b"end"


# ------------------------------------------------------------------------- shareable buffers
class SharedBuffer:
    """A ``uint8`` buffer another process on this machine can map: CUDA IPC or POSIX shm."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self._shm = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            from torch.multiprocessing.reductions import reduce_tensor
            self.handle = ("cuda", reduce_tensor(self.tensor))
        else:
            from multiprocessing import shared_memory
            self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            self.handle = ("shm", (self._shm.name, nbytes))

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # a view is still alive; unlinking still frees it at exit
                pass
            self._shm.unlink()
            self._shm = None


def open_shared(handle) -> tuple[torch.Tensor, object]:
    """Map a :class:`SharedBuffer` handle in this process; returns (tensor, keep-alive object)."""
    kind, payload = handle
    if kind == "cuda":
        fn, args = payload
        args = list(args)
        args[6] = torch.cuda.current_device()  # storage_device: this process's index of the GPU
        return fn(*args), None
    import mmap

    import _posixshmem  # what multiprocessing.shared_memory uses, minus its resource tracker

    name, nbytes = payload
    # Not SharedMemory(name=...): on Python < 3.13 it registers the segment with a resource tracker
    # that may be the trainer's own (inherited), and that tracker would then unlink it twice.
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes), mapping


# ------------------------------------------------------------------------------ engine side
def receive_ipc(worker, endpoint: str, verify: bool, timeout_s: float) -> dict:
    """Run inside the vLLM worker: take buckets from ``endpoint`` until the end marker, load them."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    mapped: dict[int, tuple[torch.Tensor, object]] = {}

    def recv():
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no bucket from the trainer within {timeout_s}s")
        return sock.recv_multipart()

    def buckets():
        while True:
            frames = recv()
            if frames[0] == _END:
                sock.send(b"ok")
                return
            slot, handle, meta = int(frames[0]), frames[1], BucketMeta.decode(frames[2])
            if handle:
                _unmap(mapped, slot)
                mapped[slot] = open_shared(pickle.loads(handle))
            data = mapped[slot][0][:meta.nbytes].clone()  # the loader may keep views: own the bytes
            if data.is_cuda:
                torch.cuda.current_stream().synchronize()
            sock.send(b"ok")  # the trainer may now refill this buffer
            yield meta, data

    try:
        return engine_side.load_buckets(worker, buckets(), verify)
    finally:
        for slot in list(mapped):
            _unmap(mapped, slot)
        sock.close()


def _unmap(mapped: dict, slot: int) -> None:
    entry = mapped.pop(slot, None)
    if entry is None:
        return
    keep = entry[1]
    del entry  # drop the tensor view before closing the mapping it points into
    if keep is not None:
        try:
            keep.close()
        except BufferError:  # a view is still alive somewhere; the OS unmaps at exit
            pass


# ----------------------------------------------------------------------------- trainer side
class CudaIpcWeightSync(WeightSync):
    """Colocated transport; see the module docstring."""

    def __init__(self, config: SyncConfig, engines: Sequence, *, sender: bool = True):
        super().__init__(config)
        self.engines = list(engines)
        self.sender = sender
        remote = [e for e in self.engines if hasattr(e, "submit")]
        if remote and len(remote) != len(self.engines):
            raise ValueError("cuda_ipc: engines must be all in-process or all remote")
        self._inprocess = None if remote else InProcessWeightSync(config, engines, sender=sender)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        for e in remote:
            if getattr(e, "workers", 1) != 1:
                raise SyncError(f"cuda_ipc: engine {e.name} has {e.workers} workers; the colocated "
                                "path supports engine tensor_parallel_size=1 (use nccl/gloo)")
        self._buffers: list[SharedBuffer] = []
        self._dir = None
        self._asleep = False

    def sleep_engines(self) -> None:
        """Free the engines' KV cache while the trainer uses the device (no-op on CPU)."""
        for e in self.engines:
            e.sleep()
        self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            for e in self.engines:
                e.wake_up()
            self._asleep = False

    def connect(self) -> None:
        if self._inprocess is not None or self._buffers or not self.sender:
            return
        self._buffers = [SharedBuffer(self.config.bucket_bytes, self.device) for _ in range(2)]
        self._dir = tempfile.mkdtemp(prefix="mrl-ipc-")

    def close(self) -> None:
        for b in self._buffers:
            b.close()
        self._buffers = []
        if self._dir is not None:
            for f in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, f))
            os.rmdir(self._dir)
            self._dir = None

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        if self._inprocess is not None:
            self._wake()
            return self._inprocess.sync(named_tensors, version)
        if not self.sender:
            return drain(named_tensors, version)
        import zmq

        cfg = self.config
        t0 = time.perf_counter()
        self.connect()
        self._wake()
        ctx = zmq.Context.instance()
        socks, pending = [], []
        metrics = SyncMetrics(version=version, engines=len(self.engines), verified=cfg.verify)
        try:
            for e in self.engines:
                endpoint = f"ipc://{self._dir}/{e.name}-{uuid.uuid4().hex[:8]}"
                sock = ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(endpoint)
                socks.append((e, sock))
                pending.append((e, e.submit("rpc", receive_ipc, (endpoint, cfg.verify, cfg.timeout_s),
                                            drain_timeout_s=cfg.timeout_s)))
            expected = self._send(named_tensors, socks, pending, metrics)
            replies = [(e, p.result(cfg.timeout_s)) for e, p in pending]
        except Exception as exc:
            for _, sock in socks:
                sock.close()
            socks = []
            invalidate(self.engines, cfg.timeout_s)
            if isinstance(exc, SyncError):
                raise
            if isinstance(exc, TimeoutError):
                raise SyncTimeout(f"weight sync v{version} (cuda_ipc): {exc}") from exc
            raise SyncError(f"weight sync v{version} (cuda_ipc) failed: {exc}") from exc
        finally:
            for _, sock in socks:
                sock.close()
        commit(replies, expected, version, cfg.verify, cfg.timeout_s)
        metrics.seconds = time.perf_counter() - t0
        return metrics

    def _send(self, named_tensors, socks, pending, metrics) -> dict[str, int]:
        cfg = self.config
        expected: dict[str, int] = {}
        handed = [False, False]  # whether each engine already mapped a buffer's handle
        awaiting = False

        def wait_acks():
            deadline = time.monotonic() + cfg.timeout_s
            for engine, sock in socks:
                while not sock.poll(50):
                    for e, p in pending:
                        p.poll()  # a dead or failed engine raises, named
                    if time.monotonic() > deadline:
                        raise SyncTimeout(f"engine {engine.name}: no acknowledgement within "
                                          f"sync.timeout_s={cfg.timeout_s}s")
                sock.recv()

        for k, items in enumerate(group_by_dtype(named_tensors, cfg.bucket_bytes)):
            slot = k % 2
            meta, data = pack(items, k, self._buffers[slot].tensor)
            if data.data_ptr() != self._buffers[slot].tensor.data_ptr():
                # a tensor larger than a bucket: it gets a one-off shared buffer of its own
                if awaiting:
                    wait_acks()
                    awaiting = False
                self._send_alone(meta, data, socks, wait_acks, expected)
                metrics.buckets += 1
                metrics.tensors += 1
                metrics.bytes += meta.nbytes
                continue
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if cfg.verify:
                expected.update(checksums(unpack(meta, data)))
            if awaiting:
                wait_acks()  # the engines copied bucket k-1 out; its buffer is free next round
            handle = b"" if handed[slot] else pickle.dumps(self._buffers[slot].handle)
            handed[slot] = True
            for _, sock in socks:
                sock.send_multipart([str(slot).encode(), handle, meta.encode()])
            awaiting = True
            metrics.buckets += 1
            metrics.tensors += len(meta.tensors)
            metrics.bytes += sum(t.nbytes for t in meta.tensors)
        if awaiting:
            wait_acks()
        for _, sock in socks:
            sock.send_multipart([_END])
        wait_acks()
        return expected

    def _send_alone(self, meta, data, socks, wait_acks, expected) -> None:
        buf = SharedBuffer(data.numel(), self.device)
        try:
            buf.tensor.copy_(data)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if self.config.verify:
                expected.update(checksums(unpack(meta, buf.tensor)))
            handle = pickle.dumps(buf.handle)
            for _, sock in socks:  # slot 2: never cached by the engine beyond this bucket
                sock.send_multipart([b"2", handle, meta.encode()])
            wait_acks()
        finally:
            buf.close()
