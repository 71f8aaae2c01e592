"""The transport registry: ``sync.transport`` name -> the module implementing it, and how the vLLM
servers of the server transports must be started. Plain data (module paths, no imports), so the
config, the interface and the transports can all read it without importing each other."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Transport:
    """A registry entry: the module that implements a transport (imported only when built), and, for
    the transports that drive vLLM servers, how those servers must be started."""

    module: str
    # The vLLM weight-transfer backend the servers run (``--weight-transfer-config``).
    backend: str | None = None
    # A module the servers' workers must import for it (``--worker-extension-cls``).
    worker_extension: str | None = None
    server_env: tuple[tuple[str, str], ...] = ()


# sync.transport -> its implementation.
TRANSPORTS: dict[str, Transport] = {
    # the engine lives in the trainer's process (the CPU demo)
    "inprocess": Transport("megatron_rl.sync.inprocess"),
    # vLLM servers; our gloo backend in vLLM's weight-transfer factory (CPU)
    "gloo": Transport("megatron_rl.sync.gloo", backend="gloo",
                      worker_extension="megatron_rl.sync.gloo.GlooWorkerExtension"),
    # vLLM servers; vLLM's NCCL backend (GPUs)
    "nccl": Transport("megatron_rl.sync.nccl", backend="nccl"),
    # vLLM servers on the trainer's own GPUs; vLLM's CUDA IPC backend (handles travel pickled over HTTP)
    "ipc": Transport("megatron_rl.sync.ipc", backend="ipc",
                     server_env=(("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"),)),
}
