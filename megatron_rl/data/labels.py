"""The difficulty rule: tell hard questions from wrong labels (seed 002), one pure function.

Given one prompt's samples (right or wrong, and the answer each gave), :func:`label_prompt` says:

* ``solved``: every sample right;
* ``suspected_wrong_label``: rarely right (pass rate <= ``suspect_max_pass_rate``, by default
  ``hard_max_pass_rate``; 0: "stuck at 0") while the wrong
  samples mostly agree on one answer that is not the label (at least ``agree_frac`` of all samples
  give it, and more often than the label is matched). The seed's signature of a wrong label:
  mostly "wrong" with the same confident answer, rarely "right" by coincidence. Only where the
  policy mostly solves prompts of this kind (``source_pass_rate``, its pass rate on the prompt's
  data source, at least ``min_source_pass_rate``): a policy that fails at a kind of problem is
  confidently wrong on it as often as a label is wrong, and the two look the same;
* ``unsolved``: no sample right, answers scattered (or agreeing, where the policy is not competent);
* ``hard``: rarely right, wrong answers scattered (the same pass rates as a wrong label: only the
  agreement of the wrong answers tells the two apart);
* ``mixed``: everything else (a useful training prompt).

The same rule labels a dataset offline (``megatron-rl data difficulty``) and watches the prompts of a
training run live (:mod:`megatron_rl.data.wrong_labels`); only who collects the samples differs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_rl.rewards.extract import normalize_ws


@dataclass
class DifficultyLabel:
    label: str
    pass_rate: float
    k: int
    n_correct: int
    majority_wrong_answer: str | None
    majority_wrong_frac: float
    distinct_wrong_answers: int


def canonical_answer(answer) -> str | None:
    """A vote key: whitespace and ``$`` removed, plain numbers in one form (``4.0`` == ``4``)."""
    if answer is None:
        return None
    a = normalize_ws(str(answer)).strip("$")
    if not a:
        return None
    try:
        x = float(a.replace("{,}", "").replace(",", ""))
    except ValueError:
        return a
    return repr(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


def label_prompt(correct: list[bool], answers: list, *, ground_truth=None,
                 hard_max_pass_rate: float = 0.25, agree_frac: float = 0.5,
                 source_pass_rate: float | None = None, min_source_pass_rate: float = 0.0,
                 suspect_max_pass_rate: float | None = None) -> DifficultyLabel:
    """Label one prompt from its samples' correctness and extracted answers (see module doc).

    With ``ground_truth``, a wrong-scored sample whose answer *is* the label (right answer, wrong
    format) casts no vote for another answer. ``source_pass_rate`` (None: unknown, no check) is the
    policy's pass rate on the prompt's kind of problem.
    """
    if len(correct) != len(answers) or not correct:
        raise ValueError("need one answer per sample and at least one sample")
    k = len(correct)
    n = sum(bool(c) for c in correct)
    label_key = canonical_answer(ground_truth)
    wrong = Counter(a for c, raw in zip(correct, answers) if not c
                    for a in [canonical_answer(raw)] if a is not None and a != label_key)
    top, top_n = (wrong.most_common(1)[0] if wrong else (None, 0))
    frac = top_n / k
    suspect_max = hard_max_pass_rate if suspect_max_pass_rate is None else suspect_max_pass_rate
    if n == k:
        label = "solved"
    elif (frac >= agree_frac and top_n > n and n / k <= suspect_max
          and (source_pass_rate is None or source_pass_rate >= min_source_pass_rate)):
        label = "suspected_wrong_label"
    elif n == 0:
        label = "unsolved"
    elif n / k <= hard_max_pass_rate:
        label = "hard"
    else:
        label = "mixed"
    return DifficultyLabel(label, n / k, k, n, top, frac, len(wrong))
