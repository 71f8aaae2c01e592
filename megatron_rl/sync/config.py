"""Configuration of the trainer -> rollout-engine weight sync."""

from __future__ import annotations

import dataclasses

from megatron_rl.config.base import ConfigBase, ranged
from megatron_rl.sync.registry import TRANSPORTS


# The keys of a transfer to vLLM servers; the in-process hand-over has none of these (it cannot be
# incomplete, so it is never retried).
TRANSFER_ONLY = ("bucket_bytes", "timeout_s", "master_addr", "retries")
SENDERS = ("owners", "gather")
# The transports whose engines receive from one trainer rank only (vLLM's).
ONE_SENDER = ("nccl", "ipc")


@dataclasses.dataclass(kw_only=True)
class SyncConfig(ConfigBase):
    """How the trained weights reach the rollout engines after every update."""

    # Transport: "inprocess" (the engine lives in the trainer's process: the CPU demo); for vLLM
    # servers (rollout.engine=vllm_server), vLLM's weight-transfer protocol over its RL routes with
    # the backend "gloo" (ours, CPU), "nccl" (vLLM's, GPUs) or "ipc" (vLLM's CUDA IPC: servers on
    # the trainer's own GPUs).
    transport: str = "inprocess"
    # Size of one packed bucket in bytes. Tensors are packed per dtype into buckets of this size; a
    # tensor larger than a bucket travels alone. Anchors: slime 512 MiB, verl 2 GiB; on CPU (gloo)
    # 16-64 MiB pipelines better (benchmarks/RESULTS.md). Servers only (refused with "inprocess").
    bucket_bytes: int = ranged(512 * 1024 * 1024, ge=1024)
    # Upper bound in seconds on every wait of a sync (group formation, each collective, each engine
    # reply). An engine that dies or hangs makes the sender give up on it within about this time.
    # Servers only (refused with "inprocess").
    timeout_s: float = ranged(120.0, gt=0.0)
    # Verify every sync: what each engine received (one checksum per packed bucket compared with
    # the sender's, gloo), the version it reports, and what it computes (probe_tolerance); an
    # engine that fails holds an unknown version and serves nothing until a later sync succeeds.
    verify: bool = True
    # With verify: after a sync every engine scores a fixed probe sequence and the trainer compares
    # those log-probs with its own; a mean absolute gap above this fails the sync on that engine
    # (catches a stale copy, cache or missing tensor that checksums cannot see). null: 1e-4 for
    # float32 engines, 3e-2 for half precision (rollout.dtype).
    probe_tolerance: float | None = ranged(None, gt=0.0)
    # Host the sender's rendezvous store binds to; engines connect to it (must be reachable from
    # every engine: the sbatch scripts set the trainer's first host). Servers only.
    master_addr: str = "127.0.0.1"
    # When a sync leaves some reachable engine without the new weights (another engine died
    # mid-transfer, a checksum differed), sync again with a fresh export up to this many times.
    # Servers only (the in-process hand-over cannot be incomplete).
    retries: int = ranged(1, ge=0)
    # Which trainer ranks send the weights. "owners": each pipeline stage's tensor-parallel rank 0
    # (of data/context-parallel replica 0) streams its own layers, gathered only over its TP group,
    # all stages at once; no rank gathers the whole model (gloo and inprocess; with one pipeline
    # stage it is rank 0 alone). "gather": rank 0 gathers the whole model and sends it alone (what
    # vLLM's nccl and ipc engines take: they receive from one trainer rank, so with pipeline
    # parallelism they need "gather").
    senders: str = "owners"

    def gather_rank(self) -> int | None:
        """The trainer rank the export is gathered to (``senders="gather"``: rank 0), or None: each
        owner sends its own (``models.hf_export.export_plan``'s ``to_rank``)."""
        return 0 if self.senders == "gather" else None

    def validate(self) -> None:
        super().validate()
        if self.transport not in TRANSPORTS:
            self.fail("transport", f"must be one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        if self.senders not in SENDERS:
            self.fail("senders", f"must be one of {list(SENDERS)}, got {self.senders!r}")
        if not self.master_addr:
            self.fail("master_addr", "must be a host name or address")
        if self.transport == "inprocess":  # the tensors are handed over: no buckets, store, waits or retries
            for name in TRANSFER_ONLY:
                if self.differs_from_default(name):
                    self.fail(name, f"acts on a weight transfer to vLLM servers (gloo, nccl, ipc) only, got "
                                    f"{getattr(self, name)!r} with transport='inprocess', which ignores it")
