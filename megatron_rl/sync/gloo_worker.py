"""The worker side of the gloo weight-transfer backend: inside every vLLM worker, join the transfer
groups (one per sender), receive packed buckets, load them in place inside vLLM's layerwise reload.

Every worker of every engine takes its own rank in each sender's group (ranks 1..N, each engine at
its own rank offset). It receives from all senders at once (two buckets in flight per sender,
loaded in a fixed round-robin order) and loads each bucket through the model's ``load_weights``
inside vLLM's layerwise reload (started by ``start_weight_update``, finalised by
``finish_weight_update``). It hashes each bucket (:data:`~megatron_rl.sync.gloo_wire.BUCKET_HASH`)
on a side thread while it loads it and the next one arrives, and the checksums are exchanged in one
all-gather at the end of the round. Every wait has a timeout; a worker whose stream is cut restores
the layers the reload had displaced (the weights are then a mix of old and new, which the sender
records as an unknown version).

Owns: this worker's groups and what its last round received (``last_round``).
May call: :mod:`megatron_rl.sync.gloo_wire`, :mod:`megatron_rl.sync.group`,
:mod:`megatron_rl.sync.buckets`, :mod:`megatron_rl.rollout.reload`, vLLM's layerwise reload and the
model's ``load_weights``.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from megatron_rl.rollout.reload import refresh_cpu_moe_experts, refresh_tied_layers
from megatron_rl.sync.buckets import bucket_nbytes, nbytes
from megatron_rl.sync.gloo_wire import (BUCKET_HASH, GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo,
                                        abort_group, sender_plans)
from megatron_rl.sync.group import allgather, broadcast, make_group, sender_prefix


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inside every vLLM worker: join the group, receive packed buckets, load them in place."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: list = []  # one per sender
        self.info: GlooWeightTransferInitInfo | None = None
        self.rank = -1
        self.reloading = False
        self._loaded: list[str] = []  # the checkpoint names loaded in this reload
        # What the last round received (also readable through /collective_rpc, see the extension).
        self.last_round: dict = {}
        self._reload_seconds: dict[str, float] = {}  # vLLM's layerwise reload: start, finish

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        self.rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.info = init_info
        n = init_info.senders
        for k in range(n):  # in sender order: sender k joins its group while the others wait in theirs
            self.groups.append(make_group(init_info.master_address, init_info.master_port, self.rank,
                                          init_info.world_size, init_info.timeout_s,
                                          prefix=sender_prefix(k, n)))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.reloading = True
        self._loaded = []
        self._reload_seconds = {"start_seconds": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        self._finish_reload()
        self.last_round["finish_seconds"] = time.perf_counter() - t0

    def _finish_reload(self) -> None:
        if self.reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self.reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            refresh_tied_layers(self.model)  # a tied output layer's packed copy follows the embedding
            refresh_cpu_moe_experts(self.model, self._loaded)  # CPU experts: packed again
            self._loaded = []

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which CPU builds lack; the
        # receive below is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if not self.groups or self.info is None:
            raise RuntimeError("gloo weight transfer is not initialised (init_weight_transfer_engine first)")
        info = self.info
        t0 = time.perf_counter()
        # the checksums run on a side thread, beside load_weights and the next bucket's receive (the
        # hash releases the GIL); each keeps its buffer alive until it is hashed
        hasher = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-hash") if update_info.verify else None
        try:
            plans = sender_plans(update_info, len(self.groups), info.bucket_bytes)
            sums, tally = self._receive_buckets(plans, hasher)
            t3 = time.perf_counter()
            digests = [[f.result(timeout=info.timeout_s) for f in fs] for fs in sums]
            hash_tail = time.perf_counter() - t3  # what hashing added after the last load
            vectors = self._exchange_checksums(digests, plans)
        except BaseException:
            # The stream was cut: put back the layers the reload had displaced (they keep a mix of old and
            # new weights, which the sender records as an unknown version), leave the broken groups.
            self._finish_reload()
            self.shutdown()
            raise
        finally:
            if hasher is not None:
                hasher.shutdown(wait=False)
        hash_s = sum(s for ds in digests for _, s in ds)
        # seconds: the whole receive; of it, wait: blocked on the broadcasts, load: vLLM's
        # load_weights (its layerwise reload processes each layer as it completes); hash: checksums
        # (on the side thread, overlapped), of which hash_tail came after the last load
        self.last_round = {"buckets": sum(len(p) for p in plans), "tensors": tally["tensors"],
                           "bytes": tally["bytes"], "seconds": time.perf_counter() - t0,
                           "wait_seconds": tally["wait"], "load_seconds": tally["load"], "hash_seconds": hash_s,
                           "hash_tail_seconds": hash_tail, **self._reload_seconds, "senders": len(plans),
                           "sender_buckets": [len(p) for p in plans],
                           "checksums": [int(x) for v in vectors for x in v.tolist()]}

    def _receive_buckets(self, plans: list[list], hasher: cf.Executor | None) -> tuple[list, dict]:
        """Every sender's buckets, received and loaded (two in flight per sender: the next arrives
        while one loads, in a fixed round-robin over the senders). Returns, per sender, the futures of
        its buckets' checksums (``hasher``'s; none without), and the tally: bytes, tensors, seconds
        blocked on the broadcasts (``wait``) and in ``load_weights`` (``load``)."""
        tally = {"bytes": 0, "tensors": 0, "wait": 0.0, "load": 0.0}
        sums: list[list[cf.Future]] = [[] for _ in plans]
        pending: list[deque] = [deque() for _ in plans]  # per sender: its buckets in flight
        posted = [0] * len(plans)

        def post(k: int) -> None:
            if posted[k] < len(plans[k]):
                items = plans[k][posted[k]]
                buf = torch.empty(bucket_nbytes(items), dtype=torch.uint8)
                pending[k].append((items, buf, broadcast(self.groups[k], buf)))
                posted[k] += 1

        for k in range(len(plans)):
            post(k)
        while any(pending):
            for k in range(len(plans)):  # a fixed round-robin over the senders
                if not pending[k]:
                    continue
                post(k)  # its next bucket arrives while this one is waited for and loaded
                items, data, work = pending[k].popleft()
                t1 = time.perf_counter()
                work.wait()
                t2 = time.perf_counter()
                if hasher is not None:
                    sums[k].append(hasher.submit(_timed_digest, data))
                self._load(items, data)
                tally["wait"] += t2 - t1
                tally["load"] += time.perf_counter() - t2
                tally["bytes"] += data.numel()
                tally["tensors"] += len(items)
        return sums, tally

    def _load(self, items: list, data: torch.Tensor) -> None:
        """One received bucket into the model (inside vLLM's layerwise reload)."""
        self.model.load_weights(unpack_tensor(
            data, [n for n, _ in items], [list(t.shape) for _, t in items],
            [t.dtype for _, t in items], [nbytes(t) for _, t in items]))
        self._loaded.extend(n for n, _ in items)

    def _exchange_checksums(self, digests: list[list], plans: list[list]) -> list[torch.Tensor]:
        """Each sender collects what every worker received of its buckets (one all-gather per group):
        this worker's checksums per sender (zeros for a round not checksummed)."""
        vectors = [torch.tensor([d for d, _ in ds], dtype=torch.int64) if ds
                   else torch.zeros(len(p), dtype=torch.int64) for ds, p in zip(digests, plans)]
        works = [allgather(g, v)[0] for g, v in zip(self.groups, vectors)]
        for work in works:
            work.wait()
        return vectors

    def shutdown(self) -> None:
        groups, self.groups = self.groups, []
        for group in groups:
            abort_group(group)


def _timed_digest(data: torch.Tensor) -> tuple[int, float]:
    t0 = time.perf_counter()
    return BUCKET_HASH(data), time.perf_counter() - t0
