"""The distillation teacher must score the policy's token ids: a checkpoint with the policy's
tokenizer is accepted (whatever its size), one with another tokenizer or too few output ids is
refused (one line naming the key and the checkpoint) before its weights are loaded."""

import pytest

from megatron_rl.demo.tiny import ALPHABET, build_char_tokenizer
from megatron_rl.trainer.teacher import TeacherError, check_teacher_tokenizer


def test_distill_teacher_tokenizer_check(tmp_path):
    ours = build_char_tokenizer()
    ours.save_pretrained(tmp_path / "same")
    check_teacher_tokenizer(str(tmp_path / "same"), ours, len(ours) + 4)  # a padded output layer
    with pytest.raises(TeacherError, match=f"^algo.distill.teacher: .* scores 20 token ids, the policy's "
                                           f"tokenizer has {len(ours)}"):
        check_teacher_tokenizer(str(tmp_path / "same"), ours, 20)
    build_char_tokenizer([*ALPHABET[:-1], "Z"]).save_pretrained(tmp_path / "other")
    with pytest.raises(TeacherError, match="^algo.distill.teacher: .*'s tokenizer is not the policy's"):
        check_teacher_tokenizer(str(tmp_path / "other"), ours, len(ours) + 4)
    (tmp_path / "bare").mkdir()  # no tokenizer files: only the vocabulary size can be checked
    check_teacher_tokenizer(str(tmp_path / "bare"), ours, len(ours))
