"""A ``gloo`` weight-transfer backend for vLLM: the CPU twin of vLLM's dense ``nccl`` backend.

vLLM 0.32 moves weights from a trainer into running servers through weight-transfer engines behind
a factory (``vllm.distributed.weight_transfer``): a trainer-side engine (``trainer_init`` /
``send_weights``) drives the server's RL routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) through a client, while the
matching worker-side engine inside every vLLM worker receives. Its ``nccl`` backend needs GPUs (and
its packed-tensor producer/consumer are CUDA-stream code), so on CPU this module registers a ``gloo``
backend with both factories, following the same protocol: the update info carries the parameter
metadata (names, dtypes, shapes); both ends cut the stream into the same packed buckets from it
(:mod:`megatron_rl.sync.gloo_wire`), so only raw bucket bytes travel, broadcast over a gloo group
of a trainer sender (its rank 0) and every worker of every engine (ranks 1..N, each engine at its
own rank offset): the trainer side is :mod:`megatron_rl.sync.gloo_trainer`, the worker side
:mod:`megatron_rl.sync.gloo_worker`.

Several senders (each pipeline stage's trainer rank sends its own layers: the update info names each
tensor's sender): one rendezvous store (hosted by the driver, which also drives the routes), one
group per sender over it (:func:`megatron_rl.sync.group.sender_prefix`), each with that sender and
every worker; each sender cuts its own tensors into buckets and broadcasts them on its group, all
senders at once; every worker receives from all of them. No sender receives another's bytes.

On top of vLLM's protocol: one checksum per packed bucket, computed by the sender while the bucket
is in flight and by every worker on a side thread while it loads the bucket, exchanged in one
all-gather at the end of the round, so the sender knows which engine received what
(``GlooTrainerWeightTransferEngine.report``); whether a round is checksummed travels with its
update info (``verify``); every wait has a timeout; a worker whose stream is cut restores the layers
the reload had displaced (the weights are then a mix of old and new, which the sender records as an
unknown version).

Registration: importing this module registers the backend in both factories. The servers import it
through ``--worker-extension-cls megatron_rl.sync.gloo.GlooWorkerExtension`` (vLLM imports that
class in every worker before it builds the worker's weight-transfer engine); the trainer imports it
when it builds the sync.

Owns: the registration, the worker extension, the transport (``sync.transport=gloo``: :func:`build`).
May call: :mod:`megatron_rl.sync.gloo_worker`, :mod:`megatron_rl.sync.gloo_trainer`,
:mod:`megatron_rl.sync.vllm_protocol`, :mod:`megatron_rl.sync.group` (the driver's store).
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from megatron_rl.rollout.route_capture import RoutesWorkerExtension
from megatron_rl.sync.gloo_trainer import GlooTrainerWeightTransferEngine
from megatron_rl.sync.gloo_wire import BACKEND, GlooTrainerInitInfo
from megatron_rl.sync.gloo_worker import GlooWeightTransferEngine
from megatron_rl.sync.group import host_store
from megatron_rl.sync.server_transport import ServerTransport
from megatron_rl.sync.vllm_protocol import ServerWeightSync


class GlooWorkerExtension(RoutesWorkerExtension):
    """Mixed into every vLLM worker by ``--worker-extension-cls``: importing this module registers
    the gloo backend in the worker before its weight-transfer engine is built. Adds one read-only
    method, callable through the server's ``/collective_rpc``, to the MoE routes' methods (vLLM takes
    one extension class: a server of this transport can also return routes)."""

    def mrl_last_weight_round(self) -> dict:
        """What this worker's gloo engine received in the last round (buckets, bytes, checksums)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last_round", {}) or {})


def register() -> None:
    """Register the backend with vLLM's worker-side and trainer-side factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


register()


# ------------------------------------------------------------------------------ the transport
def _init_info(config, world_size: int, rank: int, *, senders: int = 1, sender_index: int | None = 0,
               port: int = 0, store=None) -> GlooTrainerInitInfo:
    return GlooTrainerInitInfo(rank=rank, master_address=config.master_addr, world_size=world_size,
                               bucket_bytes=config.bucket_bytes, verify=config.verify,
                               timeout_s=config.timeout_s, senders=senders, sender_index=sender_index,
                               master_port=port, store=store)


def _host(config, world_size: int):
    """The driver's store for a transfer with several senders (its port goes to them first)."""
    return host_store(config.master_addr, world_size, config.timeout_s)


def build(config, fleet, *, rank: int, plan, group=None):
    """``sync.transport=gloo``: vLLM servers, through vLLM's protocol with this backend; every
    sender of ``plan`` streams its own tensors."""
    return ServerWeightSync(config, fleet, rank=rank, plan=plan, group=group,
                            transport=ServerTransport(BACKEND, _init_info, host=_host))
