"""The teacher of on-policy distillation (``algo.distill``): built once, on every rank, before the
first GRPO stage; a frozen forward on the policy's layout like the KL reference
(``models.reference.ReferencePolicy``), from any Hugging Face checkpoint whose tokenizer is the
policy's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from megatron_rl.common.errors import InputError

if TYPE_CHECKING:
    from megatron_rl.trainer.context import Context

log = logging.getLogger("megatron_rl")


class TeacherError(InputError, ValueError):
    """The teacher checkpoint cannot score the policy's tokens."""


def check_teacher_tokenizer(teacher_dir: str, tokenizer, teacher_vocab: int) -> None:
    """The teacher must read the policy's token ids as the policy does: its own tokenizer (when its
    directory has one) maps every token to the same id, and its output layer covers every id."""
    from transformers import AutoTokenizer

    if teacher_vocab < len(tokenizer):
        raise TeacherError(f"algo.distill.teacher: {teacher_dir} scores {teacher_vocab} token ids, "
                           f"the policy's tokenizer has {len(tokenizer)}: it cannot score them all")
    try:
        theirs = AutoTokenizer.from_pretrained(teacher_dir)
    except (OSError, ValueError):
        log.info("distillation teacher %s has no tokenizer of its own: its vocabulary (%d ids) "
                 "covers the policy's", teacher_dir, teacher_vocab)
        return
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours_vocab != their_vocab:
        differ = sorted(set(ours_vocab.items()) ^ set(their_vocab.items()))[:3]
        raise TeacherError(f"algo.distill.teacher: {teacher_dir}'s tokenizer is not the policy's "
                           f"({len(their_vocab)} vs {len(ours_vocab)} tokens; e.g. {differ}): the "
                           f"teacher must score the policy's token ids")


def ensure_teacher(ctx: Context) -> None:
    """Build the distillation teacher once (when ``algo.distill.coef > 0``), on every rank."""
    from megatron_rl.models.reference import ReferencePolicy

    d = ctx.cfg.algo.distill
    if not d.enabled or ctx.teacher is not None:
        return
    from megatron_rl.models.hf_config import read_hf_config

    # the checkpoint's config and tokenizer first: a teacher that cannot score the policy's tokens
    # fails before its weights are loaded
    check_teacher_tokenizer(d.teacher, ctx.tokenizer, read_hf_config(d.teacher).vocab_size)
    teacher = ReferencePolicy.from_hf(d.teacher, ctx.cfg.policy, ctx.groups, offload=d.offload,
                                      offload_key="algo.distill.offload")
    log.info("distillation teacher: %s (%s, %d layers, hidden %d; coef %g, %s)%s", d.teacher,
             teacher.arch.model_type, teacher.arch.num_layers, teacher.arch.hidden_size, d.coef,
             d.mode, " (offloaded between uses)" if teacher.offload else "")
    ctx.teacher = teacher
