"""Several senders of one weight sync of vLLM servers (the plan names each tensor's trainer rank:
every pipeline stage streams its own, ``sync.senders=owners``; backends with a ``host``, i.e. gloo).

The driver (global rank 0) drives the routes and decides each round; over the trainer's process
group it announces the round to every rank (whether it sends, and, when the transfer group is
(re-)formed, the store the other senders join: :class:`~megatron_rl.sync.base.SenderRound`; while
it waits for restarted engines, a "wait" every minute, so no rank's collective times out), every
sender streams its own buckets on its group (:func:`follow`), and the driver collects each sender's
checksums and bytes (:func:`merge`), which it checks as its own.

Owns: nothing (functions over a rank's transfer group and the senders' side channel).
May call: :class:`~megatron_rl.sync.transfer_group.TransferGroup`,
:class:`~megatron_rl.sync.base.SenderRound` (collective over the trainer's ranks).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.sync.base import DRIVER, NamedTensors, SenderRound, SyncError, SyncMetrics
from megatron_rl.sync.server_transport import ServerTransport
from megatron_rl.sync.transfer_group import TransferGroup


def follow(group: TransferGroup, senders: SenderRound | None, transport: ServerTransport,
           named_tensors: NamedTensors, version: int) -> SyncMetrics:
    """A rank other than the driver. One sender: walk the export (rank 0 sends it all). Several:
    take the driver's announcement, (re-)join this sender's group when told, stream this rank's
    buckets, and report them (or the failure) to the driver."""
    source = group.source
    if senders is None:
        if group.engine is None:
            group.connect_walker()
        source.stream = transport.wrap(named_tensors, source.metadata())
        group.engine.send_weights()
        return SyncMetrics(version=version)
    plan = senders.announce(None)
    while plan.get("wait"):  # the driver waits for restarted engines
        plan = senders.announce(None)
    stream = iter(named_tensors)
    outcome = None
    try:
        if group.sender_index is not None and plan["send"]:
            if plan["form"] is not None or group.engine is None:
                if plan["form"] is None:
                    raise SyncError("no transfer group to send on (it failed to form)")
                group.join(plan["form"])
            source.stream = stream
            group.engine.send_weights()
            outcome = {"rank": group.rank, "index": group.sender_index, "report": group.engine.report}
    except Exception as exc:  # noqa: BLE001 - the driver attributes it
        outcome = {"rank": group.rank, "index": group.sender_index, "error": f"{type(exc).__name__}: {exc}"}
        group.drop_engine()  # the group is unusable; the workers waiting on it fail at once
    finally:
        for _ in stream:  # the export is collective: walk it to the end whatever happened
            pass
    senders.collect(outcome)
    return SyncMetrics(version=version)


def merge(senders: SenderRound, group: TransferGroup, mine, failures: dict[str, str], members: list):
    """The driver: every sender's report (checksums and names in sender order, bytes per rank)
    as one, or the round's failures when a sender failed."""
    outcomes = [o for o in senders.collect(None) if o is not None]
    errors = {o["rank"]: o["error"] for o in outcomes if "error" in o}
    if errors and not failures:  # the workers waited on that sender: the round is cut
        cause = "; ".join(f"sender rank {r}: {e}" for r, e in sorted(errors.items()))
        failures = {e.name: f"the round was cut ({cause})" for e in members}
        group.teardown()
    if failures or mine is None:
        return None, failures
    parts = sorted([(group.sender_index, DRIVER, mine)] +
                   [(o["index"], o["rank"], o["report"]) for o in outcomes if "report" in o],
                   key=lambda p: p[0])
    merged = dataclasses.replace(mine, bucket_names=[], sent=[], received={}, buckets=0, tensors=0,
                                 bytes=0, hash_seconds=0.0, sender_bytes={})
    for _, rank, part in parts:
        merged.bucket_names += part.bucket_names
        merged.sent += part.sent
        for r, sums in part.received.items():
            merged.received.setdefault(r, []).extend(sums)
        merged.buckets += part.buckets
        merged.tensors += part.tensors
        merged.bytes += part.bytes
        merged.hash_seconds = max(merged.hash_seconds, part.hash_seconds)  # in parallel
        merged.sender_bytes[rank] = part.bytes
    return merged, failures
