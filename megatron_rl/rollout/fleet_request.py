"""One copy of a request on one engine of the fleet: sending it, bounding it, holding its result.

A copy fails (:class:`Requeue`: the request must go to another engine) when its engine died,
refused or cut the connection, answered an error, or did not answer within ``rollout.timeout_s``
(the engine is then marked DOWN), or when its engine went down meanwhile. A request the server
refused itself (HTTP 4xx) is raised as it is: re-sending it elsewhere would not help.

The verification hold: an engine resumed with new weights before its probe passed (the weight
sync's commit; partial rollouts) runs unverified weights; what it returns meanwhile is held until
the sync admits it, and re-sent if the sync fails it instead (its later tokens came from weights
that failed their check). One not verified within ``rollout.timeout_s`` is taken out (unknown
weights: it rejoins the next sync).

Owns: :class:`Flight` (a prompt's request and its copies in flight), :class:`Requeue`.
May call: the engine's ``submit``; :class:`~megatron_rl.rollout.fleet_members.Members` (mark_down,
mark_unknown).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from megatron_rl.rollout.base import Completion, EngineError, SamplingSpec
from megatron_rl.rollout.fleet_members import EngineState, Members, Slot


class Requeue(Exception):
    """The request must go to another engine."""


@dataclass(eq=False)
class Flight:
    """One prompt's request and the copies of it in flight (more than one when hedged)."""

    prompt_ids: list[int]
    sampling: SamplingSpec
    request_id: str | None
    changed: asyncio.Event
    copies: dict = field(default_factory=dict)  # copy task -> the slot serving it
    primary: Slot | None = None                 # the slot the request was dispatched to
    started: float = 0.0                        # loop time the primary copy was sent
    # The id its copies carry on engines that can abort (the caller's request_id; with hedging, one
    # of the fleet's, so that a losing copy can be aborted); None: none.
    wire_id: str | None = None
    answered: bool = False                      # a copy's answer was taken (the others lost)


async def send(members: Members, slot: Slot, prompt_ids: list[int], sampling: SamplingSpec,
               request_id: str | None, timeout_s: float) -> list[Completion]:
    """One copy on ``slot``'s engine, within ``timeout_s``; raises :class:`Requeue` when it failed."""
    from megatron_rl.rollout.server_http import RequestRejected

    can_abort = getattr(slot.engine, "abort", None) is not None
    extra = {} if request_id is None or not can_abort else {"request_id": request_id}
    request = asyncio.ensure_future(slot.engine.submit(prompt_ids, sampling, **extra))
    down = asyncio.ensure_future(slot.down.wait())
    slot.tasks.add(request)
    try:  # (a server bounds its request by the same timeout; this bounds any engine's)
        await asyncio.wait({request, down}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # aborted: the HTTP request goes too
        request.cancel()
        raise
    finally:
        slot.tasks.discard(request)
        down.cancel()
    if not request.done():
        request.cancel()
        if not slot.down.is_set():
            members.mark_down(slot.engine, f"engine {slot.engine.name}: no answer to a generation request "
                                           f"within rollout.timeout_s={timeout_s:g}s")
            raise Requeue(slot.reason)
        raise Requeue(f"engine {slot.engine.name} went down ({slot.reason})")
    try:
        out = request.result()
    except RequestRejected:
        raise
    except EngineError as exc:
        members.mark_down(slot.engine, str(exc))
        raise Requeue(str(exc)) from exc
    return out


async def until_verified(members: Members, slot: Slot, timeout_s: float) -> None:
    """Hold a result of an engine that runs unverified weights until the sync admits it (see the
    module doc); raises :class:`Requeue` when it failed the sync or was not verified in time."""
    verified = asyncio.ensure_future(slot.verified.wait())
    down = asyncio.ensure_future(slot.down.wait())
    try:
        await asyncio.wait({verified, down}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        verified.cancel()
        down.cancel()
    if slot.down.is_set():
        raise Requeue(f"engine {slot.engine.name} resumed with new weights that failed their check "
                      f"({slot.reason})")
    if not slot.verified.is_set():  # out until a sync verifies it (the other requests held there too)
        reason = (f"engine {slot.engine.name} resumed with new weights that were not verified within "
                  f"rollout.timeout_s={timeout_s:g}s")
        if slot.state is EngineState.UP:
            members.mark_unknown(slot.engine, reason)
        raise Requeue(reason)


def consume(task: asyncio.Future) -> None:
    """Done callback of a task nobody awaits: its exception (an engine failure, already handled)
    is retrieved so asyncio does not report it."""
    if not task.cancelled():
        task.exception()
