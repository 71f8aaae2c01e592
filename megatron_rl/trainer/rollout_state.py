"""What the async rollout scheduler saves with a checkpoint: every group not trained on yet.

Finished groups and partial ones (their samples so far) are saved in full; groups still generating
with nothing kept as (prompt, seed), redrawn on resume. A synchronous run (``max_staleness`` 0)
resumes only the groups it may still train on (:func:`fresh`).

Owns: the file format (``rollouts.pt`` in the checkpoint, :data:`STATE_FILE`).
May call: :mod:`megatron_rl.trainer.rollout_group`; torch's save / load (weights-only).
"""

from __future__ import annotations

import torch

from megatron_rl.rollout import Completion
from megatron_rl.trainer.rollout_group import Group

STATE_FILE = "rollouts.pt"


def group_dict(g: Group) -> dict:
    """A group as the checkpoint holds it (its completions None while it has none)."""
    return {"wave": g.wave, "index": g.index, "record": g.record, "dispatch_version": g.dispatch_version,
            "completions": None if g.completions is None else [completion_dict(c) for c in g.completions]}


def group_from_dict(d: dict) -> Group:
    """A saved group (its completions, if any, back as :class:`Completion`)."""
    g = Group(wave=d["wave"], index=d["index"], record=d["record"], dispatch_version=d["dispatch_version"])
    if d["completions"] is not None:
        g.completions = [completion_from_dict(c) for c in d["completions"]]
    return g


def fresh(d: dict, version: int, step: int) -> bool:
    """A saved group that a synchronous run (max_staleness 0) may still train on: its own step's
    (drawn for ``step`` or later), generated (if at all) by the current weights."""
    if d["wave"] < step:
        return False
    return d["completions"] is None or all(c["weight_version"] == version for c in d["completions"])


def completion_dict(c: Completion) -> dict:
    return {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs), "text": c.text,
            "finish_reason": c.finish_reason, "truncated": bool(c.truncated),
            "weight_version": int(c.weight_version), "version_spans": [list(s) for s in c.version_spans],
            "loss_mask": list(c.loss_mask), "extra": dict(c.extra),
            # MoE routing replay: the engine's routes (a tensor: the state is loaded weights-only)
            "routes": None if c.routes is None else torch.from_numpy(c.routes)}


def completion_from_dict(d: dict) -> Completion:
    routes = d.get("routes")
    return Completion(**{**d, "version_spans": [tuple(x) for x in d["version_spans"]],
                         "routes": None if routes is None else routes.numpy()})


def save(state: dict, ckpt) -> None:
    torch.save(state, ckpt / STATE_FILE)


def load(ckpt) -> dict | None:
    """The state saved in checkpoint directory ``ckpt`` (None: no checkpoint, or none saved there)."""
    path = None if ckpt is None else ckpt / STATE_FILE
    if path is None or not path.exists():
        return None
    return torch.load(path, weights_only=True)
