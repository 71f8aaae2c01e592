"""The weight-transfer group of one trainer rank: vLLM's trainer-side engine and, on the driver, the
:class:`~megatron_rl.sync.fleet_client.FleetClient` of the engines it spans.

The driver (global rank 0) forms the group around the fleet's sync targets (:meth:`TransferGroup.form`;
with several senders at the store it hosts for them), another sender joins its own group at that
store (:meth:`TransferGroup.join`), a rank that sends nothing keeps an engine that only walks the
collective export (:meth:`TransferGroup.connect_walker`). After a failed round the group is unusable
and torn down (:meth:`TransferGroup.teardown`); the next round forms it again.

Owns: the trainer-side weight-transfer engine (``engine``), the client (``client``) and the names of
the engines the group spans (``members``).
May call: vLLM's ``WeightTransferTrainerFactory``, the transport's ``init_info``, the client.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from megatron_rl.sync.base import DRIVER, SendPlan, SyncError
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.fleet_client import FleetClient
from megatron_rl.sync.server_transport import ServerTransport, StreamSource


class TransferGroup:
    """This rank's part of the weight-transfer group (see the module doc)."""

    def __init__(self, config: SyncConfig, transport: ServerTransport, source: StreamSource,
                 plan: SendPlan, rank: int):
        self.config = config
        self.transport = transport
        self.source = source
        self.plan = plan
        self.rank = rank
        self.sender_index = plan.index(rank)
        self.several = len(plan.senders) > 1
        self.engine = None  # vLLM's trainer-side weight-transfer engine
        self.client: FleetClient | None = None
        self.members: list[str] = []

    def standing(self, members: list) -> bool:
        """The group is formed, around exactly ``members``."""
        return self.client is not None and self.engine is not None and [e.name for e in members] == self.members

    def connect_walker(self) -> None:
        """A rank other than the driver that sends nothing (or one of a single sender's group): an
        engine that walks its (collective) export."""
        if self.sender_index is None or not self.several:
            info = self.transport.init_info(self.config, 1, self.rank, sender_index=None)
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=self.source)

    def form(self, members: list, store=None) -> None:
        """The driver: a new group around ``members`` (several senders: at ``store``)."""
        self.teardown()
        client = FleetClient(members, self.config.timeout_s)
        extra = {} if not self.several else dict(senders=len(self.plan.senders), sender_index=self.sender_index,
                                                 store=store, port=store.port)
        info = self.transport.init_info(self.config, client.world_size, DRIVER, **extra)
        try:
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
        except BaseException:
            client.close()
            raise
        self.client = client
        self.members = [e.name for e in members]

    def join(self, form: dict) -> None:
        """Another sender: (re-)join its group at the driver's store (``form``: port, world size)."""
        self.drop_engine()
        info = self.transport.init_info(self.config, form["world"], self.rank, senders=len(self.plan.senders),
                                        sender_index=self.sender_index, port=form["port"])
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=self.source)

    def drop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass

    def teardown(self) -> None:
        """Drop the engine and the client (the servers leave the group: a later init re-forms it)."""
        self.drop_engine()
        client, self.client = self.client, None
        self.members = []
        if client is not None:
            client.wait_idle(self.config.timeout_s)
            try:
                client.shutdown_weight_transfer_engine()
            except SyncError:
                pass  # engines that are gone; the others re-initialise on the next init
            client.close()
