"""Synthetic verifiable tasks for the CPU demos and the tests: multi-digit addition (the demo) and
multiplication (the tool demo: a task the tiny model cannot do in its head, and can with a calculator).

A problem ``a+b`` (or ``a*b``) with 2–3 digit operands; the reference solution is ``\\boxed{a+b}``, or,
with the calculator environment, the demonstrated trajectory ``<<a*b>>`` (a call), the tool's answer,
``\\boxed{...}``. Problems are a pure function of (seed, index), and the held-out evaluation set is
drawn from a disjoint part of the problem space (by a hash of the problem), so no evaluation problem
is ever trained on.

Rows are written in verl's format (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``reward_model.style``, ``extra_info``) so the demo exercises the same
loader as real datasets.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "synthetic/addition"
REWARD_STYLE = "boxed_final"
# task -> its operator; the data source is "synthetic/<task>"
TASKS = {"addition": "+", "multiplication": "*"}
# Environments whose call format the demonstrations can show (demo.config.SyntheticConfig.env).
DEMO_ENVS = ("calculator",)


def data_source(task: str) -> str:
    return f"synthetic/{task}"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str = "+"

    @property
    def question(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b if self.op == "*" else self.a + self.b)

    def trajectory(self, answer: str | None = None) -> list[dict]:
        """The demonstrated calculator trajectory: the call, the tool's answer, the boxed answer."""
        value = self.answer if answer is None else answer
        return [{"role": "assistant", "content": f"<<{self.a}{self.op}{self.b}>>"},
                {"role": "tool", "content": self.answer},
                {"role": "assistant", "content": f"\\boxed{{{value}}}"}]

    @property
    def solution(self) -> str:
        """The reference response the SFT cold start imitates."""
        return f"\\boxed{{{self.answer}}}"


def _is_heldout(p: Problem, heldout_fraction: float) -> bool:
    digest = hashlib.sha256(f"{p.a}{p.op}{p.b}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < heldout_fraction


def sample_problems(n: int, seed: int, split: str, min_digits: int = 2, max_digits: int = 3,
                    heldout_fraction: float = 0.1, op: str = "+") -> list[Problem]:
    """``n`` distinct problems of ``split`` ('train' or 'eval'); the two splits never overlap."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    lo, hi = 10 ** (min_digits - 1), 10**max_digits - 1
    space = (hi - lo + 1) ** 2
    want_eval = split == "eval"
    if n > space * (heldout_fraction if want_eval else 1 - heldout_fraction) * 0.9:
        raise ValueError(f"cannot draw {n} distinct {split} problems from {min_digits}-{max_digits} digits")
    rng = random.Random(f"{seed}-{split}")
    seen: set[tuple[int, int]] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(rng.randint(lo, hi), rng.randint(lo, hi), op)
        if (p.a, p.b) in seen or _is_heldout(p, heldout_fraction) != want_eval:
            continue
        seen.add((p.a, p.b))
        out.append(p)
    return out


def to_verl_row(p: Problem, index: int, split: str, ground_truth: str | None = None,
                data_source: str = DATA_SOURCE, env: str = "") -> dict:
    """A verl row; ``ground_truth`` overrides the true answer (a planted wrong label). With ``env``
    ("calculator") the row names its environment and its solution is a demonstrated trajectory."""
    gt = p.answer if ground_truth is None else ground_truth
    extra = {"split": split, "index": index, "uid": f"{split}-{index}",
             "solution": p.trajectory(gt) if env else f"\\boxed{{{gt}}}"}
    if env:
        extra["env"] = env
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": p.question}],
        "ability": "arithmetic",
        "reward_model": {"style": REWARD_STYLE, "ground_truth": gt},
        "extra_info": extra,
    }


def write_dataset(path: str | Path, problems: list[Problem], split: str,
                  labels: dict[int, str] | None = None, sources: dict[int, str] | None = None,
                  source: str = DATA_SOURCE, env: str = "") -> Path:
    """Write problems as verl-format JSON lines; ``labels`` / ``sources`` map a row index to a
    planted label / another data source than ``source``; ``env``: the environment every row names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, p in enumerate(problems):
            row = to_verl_row(p, i, split, (labels or {}).get(i), (sources or {}).get(i, source), env)
            f.write(json.dumps(row) + "\n")
    return path


def held_out_kind(max_digits: int, source: str = DATA_SOURCE) -> str:
    """The data source of the planted hard problems (an operand one digit longer than the task's)."""
    return f"{source}_{max_digits + 1}digit"


def plant(problems: list[Problem], seed: int, wrong_label_fraction: float, hard_fraction: float,
          max_digits: int) -> tuple[list[Problem], dict[int, str], dict[str, list[int]]]:
    """Plant wrong labels and hard problems among ``problems`` (data cleaning's test set).

    Returns the problems (some replaced by hard ones: an operand with ``max_digits + 1`` digits, a
    kind no other problem has, with their own data source :func:`held_out_kind`), the wrong labels
    by row index (the sum plus a nonzero offset in [-99, 99], kept positive), and the planted row
    indices by kind.
    """
    rng = random.Random(f"{seed}-plant")
    n = len(problems)
    rows = rng.sample(range(n), round(n * wrong_label_fraction) + round(n * hard_fraction))
    wrong_rows, hard_rows = rows[: round(n * wrong_label_fraction)], rows[round(n * wrong_label_fraction):]
    out = list(problems)
    for i in hard_rows:
        out[i] = Problem(rng.randint(10**max_digits, 10 ** (max_digits + 1) - 1), problems[i].b, problems[i].op)
    labels = {}
    for i in wrong_rows:
        offset = rng.choice([d for d in range(-99, 100) if d])
        s = int(out[i].answer)
        labels[i] = str(s + offset if s + offset > 0 else s - offset)
    return out, labels, {"wrong_label": sorted(wrong_rows), "hard": sorted(hard_rows)}


# Every character the tasks, their chat template and their solutions can produce (multiplication and
# the calculator's "<<expression>>" calls appended last: the padded vocabulary, 32, is unchanged, so
# the tiny models built before are the same).
ALPHABET = list("0123456789+=\\boxed{}QA: \n") + ["*", "<", ">"]
