"""What the weight sync of vLLM servers checks of each engine after a round, and what it does with
an engine that failed.

Per engine, after vLLM's finish route loaded and tagged the version: the checksums its workers
received against those sent (:func:`compare`, one per packed bucket where the backend reports them),
each of the sync's checks (the reported version first: :func:`check_reported_version`), the prefix-cache
reset beside them, then the probe (every engine scores a fixed sequence and must match the trainer's
log-probs, :mod:`megatron_rl.sync.probe`), then it is admitted (:func:`commit`). A failed round is
attributed to the engines it is due to (:func:`attribute`); an engine that failed and still answers
holds unknown weights and rejoins the next sync, one that does not is down (:func:`fail`).

Owns: nothing (functions over the fleet and the round's report).
May call: the fleet (resume_paused, admit, mark_unknown, mark_down), the engines' control routes
(health, reset_prefix_cache, set_weight_version, server_weight_version), the probe.
"""

from __future__ import annotations

import concurrent.futures as cf

from megatron_rl.rollout.base import UNKNOWN_VERSION, EngineError
from megatron_rl.sync import probe
from megatron_rl.sync.base import SyncError, SyncTimeout
from megatron_rl.sync.config import SyncConfig


def check_reported_version(engine, version: int) -> None:
    """The engine says it holds ``version`` (what ``/weight_info`` reports after the finish route
    tagged it)."""
    reported = engine.server_weight_version()
    if reported != str(version):
        raise SyncError(f"engine {engine.name} reports weight version {reported!r}, expected {version}")


def commit(fleet, engine, version: int, aside: cf.Executor, reference, checks: list,
           config: SyncConfig) -> dict | None:
    """After the finish route loaded and tagged ``version`` (vLLM's finish takes the version):
    reset the engine's prefix cache while its checks run (each of ``checks``, the reported
    version first), score the probe (what it computes with the new weights), then admit it.
    Returns its probe gap (None: no probe).

    The engine was paused for the round (``fleet.hold()``; partial rollouts: with the whole
    fleet): it resumes before the probe, which a server paused in mode keep would not schedule;
    what it kept frozen continues then, with the new weights (the reset dropped their KV, so it
    is recomputed), under the new version's label, and the fleet holds what it returns until
    the fleet's ``admit`` (or re-sends it if the probe fails)."""
    # cached blocks (running requests' too) hold the old weights' KV; ``aside`` has a worker free
    resetting = aside.submit(engine.reset_prefix_cache)
    for check in checks:
        check(engine, version)
    try:
        resetting.result(timeout=config.timeout_s)  # (the call has its own timeout)
    except cf.TimeoutError:
        raise SyncTimeout(f"engine {engine.name}: /reset_prefix_cache did not answer within "
                          f"{config.timeout_s:g}s") from None
    engine.weight_version = version  # verified
    fleet.resume_paused(engine)
    gap = probe.check(engine, reference) if (config.verify and reference is not None) else None
    fleet.admit(engine)
    return gap


def fail(fleet, engine, reason: str) -> None:
    """After a failed sync: a reachable engine holds unknown weights and rejoins the next sync;
    an unreachable one is down (its launcher restarts it)."""
    if engine.health():
        try:
            engine.set_weight_version(UNKNOWN_VERSION)
        except EngineError:
            pass
        fleet.mark_unknown(engine, reason)
    else:
        fleet.mark_down(engine, f"failed weight sync: {reason}")


def attribute(exc: Exception, members: list) -> dict[str, str]:
    """Which engines a failed round is due to; when none can be named, all of them."""
    named = dict(getattr(exc, "failures", {}) or {})
    for engine in members:
        if engine.name not in named and not engine.health(timeout=5.0):
            named[engine.name] = f"died during the sync ({type(exc).__name__}: {exc})"
    survivors = {e.name for e in members} - set(named)
    cause = f"the round was cut ({type(exc).__name__}: {exc})"
    for name in survivors:  # their receive was cut by the failure: mixed weights
        named[name] = cause
    return named


def compare(report, members: list) -> dict[str, str]:
    """Engines whose workers received other bytes than were sent, naming the first bucket."""
    if not report.received:
        return {}
    bad: dict[str, str] = {}
    rank = 1
    for engine in members:
        for w in range(engine.workers):
            got = report.received.get(rank + w)
            if got is None:
                continue
            diff = [k for k, (a, b) in enumerate(zip(report.sent, got)) if a != b]
            if diff and engine.name not in bad:
                k = diff[0]
                names = report.bucket_names[k]
                bad[engine.name] = (f"checksum mismatch (worker {w}) in {len(diff)} of {report.buckets} "
                                    f"buckets, first bucket {k}: {names[:3]}"
                                    + (f" and {len(names) - 3} more tensors" if len(names) > 3 else ""))
        rank += engine.workers
    return bad


def timed_out(failures: dict[str, str]) -> bool:
    return bool(failures) and all("Timeout" in r or "no answer" in r or "timed out" in r.lower()
                                  for r in failures.values())
