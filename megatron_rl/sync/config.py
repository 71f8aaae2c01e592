"""Configuration of the trainer → rollout-engine weight sync."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config.base import ConfigBase

TRANSPORTS = ("inprocess", "gloo", "nccl", "cuda_ipc")


@dataclasses.dataclass(kw_only=True)
class SyncConfig(ConfigBase):
    """How the trained weights reach the rollout engines after every update."""

    # Transport: "inprocess" (engine lives in the trainer's process, CPU demo), "gloo" (engines in
    # their own processes, CPU collectives), "nccl" (engines in their own processes, GPU
    # collectives), "cuda_ipc" (engine colocated on the trainer's GPU; CUDA IPC handles).
    transport: Literal["inprocess", "gloo", "nccl", "cuda_ipc"] = "inprocess"
    # Size of one flat bucket in bytes. Tensors are packed per dtype into buckets of this size; a
    # tensor larger than a bucket travels alone. Anchors: slime 512 MiB, verl 2 GiB.
    bucket_bytes: int = 512 * 1024 * 1024
    # Upper bound in seconds on every wait of a sync (group formation, each collective, each engine
    # reply). An engine that dies or hangs makes the sender raise within about this time.
    timeout_s: float = 120.0
    # After a sync, check it: the checksum of every tensor each engine received against the
    # sender's, each engine's weight version, and what the engines compute (probe_tolerance); raise
    # on any mismatch, naming the engine (and the tensor).
    verify: bool = True
    # With verify: after a sync every engine scores a fixed probe sequence and the trainer compares
    # those log-probs with its own; a mean absolute gap above this fails the sync (catches a stale
    # copy, cache or missing tensor that checksums cannot see). null: 1e-4 for float32 engines,
    # 3e-2 for half precision (rollout.dtype).
    probe_tolerance: float | None = None
    # Host the sender's rendezvous store binds to; engines connect to it (collective transports).
    master_addr: str = "127.0.0.1"

    def validate(self) -> None:
        super().validate()
        if self.transport not in TRANSPORTS:
            self.fail("transport", f"must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        if self.bucket_bytes < 1024:
            self.fail("bucket_bytes", f"must be >= 1024 bytes, got {self.bucket_bytes!r}")
        self.check_range("timeout_s", lo=0.0, lo_open=True)
        if self.probe_tolerance is not None:
            self.check_range("probe_tolerance", lo=0.0, lo_open=True)
        if not self.master_addr:
            self.fail("master_addr", "must be a host name or address")
