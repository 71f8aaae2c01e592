"""Suspected wrong labels, found live: every training prompt's samples through the difficulty rule.

Each GRPO step hands the monitor the step's groups (a prompt, its samples' correctness and the
answers they gave). The monitor keeps each prompt's newest ``window`` samples and labels the prompt
with :func:`megatron_rl.data.labels.label_prompt`, the rule the offline labeller uses; a prompt
labelled ``suspected_wrong_label`` (stuck wrong while most samples agree on one answer that is not
the label, where the policy mostly solves prompts of its data source) is on the list, a hard prompt
(rarely right, answers scattered) is not. The list is
rewritten to ``RUN_DIR/rollouts/wrong_labels.json`` every ``write_every`` steps and at each stage's
end, and counted in the metric ``data/suspected_wrong_labels`` after every step; the state travels in checkpoints, so a resumed run keeps it.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config.base import ConfigBase, ranged
from megatron_rl.data.labels import canonical_answer, label_prompt

SUSPECT = "suspected_wrong_label"
FILE_NAME = "wrong_labels.json"
# Known answers to score the list against, relative to the run directory: {"wrong_label": [uid,
# ...], "hard": [uid, ...]} (prompts known to be mislabelled / hard but rightly labelled). The demo
# writes it when it plants labels (synthetic.wrong_label_fraction); a reviewed list works the same.
PLANTED_FILE = "data/planted.json"


@dataclass(kw_only=True)
class WrongLabelConfig(ConfigBase):
    # Watch every training prompt's samples during GRPO and keep the list of suspected wrong labels.
    enabled: bool = True
    # The rule sees each prompt's newest this many samples (0: every sample it ever had): the
    # policy changes, and its recent answers say most about the label.
    window: int = ranged(64, ge=0)
    # A prompt is labelled once it has at least this many samples.
    min_samples: int = ranged(16, ge=1)
    # The rule's thresholds (megatron_rl.data.labels.label_prompt): share of the samples that must
    # give the same wrong answer, the pass rate up to which a prompt is "hard", the pass rate up to
    # which it can be a wrong label (0: stuck at 0, no sample of the window right) ...
    agree_frac: float = ranged(0.5, gt=0.0, le=1.0)
    hard_max_pass_rate: float = ranged(0.25, ge=0.0, le=1.0)
    suspect_max_pass_rate: float = ranged(0.0, ge=0.0, le=1.0)
    # ... and the pass rate the policy must reach on a data source before a consensus against a
    # label of that source counts: a policy that fails at a kind of problem is as confidently wrong
    # on it as a wrong label is. Measured over the source's newest ``source_window`` samples.
    min_source_pass_rate: float = ranged(0.5, ge=0.0, le=1.0)
    source_window: int = ranged(4096, ge=1)
    # Prompts listed as "hard, kept off the list" in the report (most samples first).
    hard_examples: int = ranged(50, ge=0)
    # Rewrite RUN_DIR/rollouts/wrong_labels.json every this many steps and at the end of each stage
    # (the list itself and the metric follow every step).
    write_every: int = ranged(10, ge=1)
    # Labelled prompts drawn in the report's map of the rule (pass rate vs agreement); past this
    # many, the listed and hard ones and then a fixed share of the rest (0: none).
    points_max: int = ranged(5000, ge=0)

    def validate(self) -> None:
        super().validate()
        if self.window and self.window < self.min_samples:
            self.fail("window", f"must be 0 or >= min_samples ({self.min_samples}), got {self.window}")


@dataclass
class PromptHistory:
    """One prompt's samples as the rule sees them, and how long it has been on the list."""

    uid: str
    ground_truth: str
    prompt: str
    source: str = ""
    # Newest samples: (right?, canonical answer or None).
    recent: deque = field(default_factory=deque)
    samples: int = 0
    correct: int = 0
    visits: int = 0
    first_step: int = 0
    last_step: int = 0
    label: str = ""
    flagged_since: int | None = None
    majority_answer: str | None = None
    agreement: float = 0.0

    def entry(self) -> dict:
        return {"uid": self.uid, "data_source": self.source, "ground_truth": self.ground_truth,
                "prompt": self.prompt,
                "label": self.label, "majority_answer": self.majority_answer,
                "agreement": round(self.agreement, 4), "samples": self.samples, "visits": self.visits,
                "pass_rate": round(self.correct / max(1, self.samples), 4),
                "recent_pass_rate": round(sum(c for c, _ in self.recent) / max(1, len(self.recent)), 4),
                "distinct_answers": len({a for _, a in self.recent if a is not None}),
                "first_step": self.first_step, "last_step": self.last_step,
                "flagged_since": self.flagged_since}


class SourcePassRate:
    """The pass rate over a data source's newest ``n`` samples."""

    def __init__(self, n: int, outcomes=()):
        self.recent: deque = deque(maxlen=n)
        self.right = 0
        self.extend(outcomes)

    def extend(self, outcomes) -> None:
        for c in outcomes:
            if len(self.recent) == self.recent.maxlen:
                self.right -= self.recent[0]
            self.recent.append(bool(c))
            self.right += bool(c)

    @property
    def rate(self) -> float:
        return self.right / len(self.recent) if self.recent else 0.0


class WrongLabelMonitor:
    """``observe(step, groups)`` after every GRPO step; ``suspects()`` is the current list."""

    def __init__(self, cfg: WrongLabelConfig):
        self.cfg = cfg
        self.prompts: dict[str, PromptHistory] = {}
        self.sources: dict[str, SourcePassRate] = {}
        self.label_counts: Counter = Counter()

    def observe(self, step: int, groups) -> dict:
        """``groups``: ``(uid, ground_truth, prompt_text, data_source, correct: list[bool], answers)``.

        A prompt that appears twice in one step is one prompt with both groups' samples. The data
        sources' pass rates take in the whole step before any prompt is labelled.
        """
        cfg = self.cfg
        for _, _, _, source, correct, _ in groups:
            self.sources.setdefault(source, SourcePassRate(cfg.source_window)).extend(correct)
        for uid, gt, prompt, source, correct, answers in groups:
            h = self.prompts.get(uid)
            if h is None:
                h = self.prompts[uid] = PromptHistory(uid, str(gt), str(prompt)[:300], source,
                                                      deque(maxlen=cfg.window or None), first_step=step)
            if h.last_step != step or h.visits == 0:
                h.visits += 1
            h.last_step = step
            for c, a in zip(correct, answers):
                h.recent.append((bool(c), canonical_answer(a)))
            h.samples += len(correct)
            h.correct += sum(bool(c) for c in correct)
            if len(h.recent) < cfg.min_samples:
                continue
            lab = label_prompt([c for c, _ in h.recent], [a for _, a in h.recent],
                               ground_truth=h.ground_truth, agree_frac=cfg.agree_frac,
                               hard_max_pass_rate=cfg.hard_max_pass_rate,
                               source_pass_rate=self.sources[source].rate,
                               min_source_pass_rate=cfg.min_source_pass_rate,
                               suspect_max_pass_rate=cfg.suspect_max_pass_rate)
            if h.label:
                self.label_counts[h.label] -= 1
            self.label_counts[lab.label] += 1
            h.label, h.majority_answer, h.agreement = lab.label, lab.majority_wrong_answer, lab.majority_wrong_frac
            if lab.label == SUSPECT:
                h.flagged_since = step if h.flagged_since is None else h.flagged_since
            else:
                h.flagged_since = None
        return {"data/suspected_wrong_labels": float(self.label_counts[SUSPECT]),
                "data/prompts_labelled": float(sum(self.label_counts.values())),
                "data/prompts_seen": float(len(self.prompts))}

    def suspects(self) -> list[dict]:
        """The list, most confident first."""
        out = [h.entry() for h in self.prompts.values() if h.label == SUSPECT]
        return sorted(out, key=lambda e: (-e["agreement"], e["uid"]))

    def hard_kept_off(self) -> list[dict]:
        """Rarely-right prompts the rule kept off the list (answers scattered), most samples first."""
        hard = (h for h in self.prompts.values() if h.label in ("hard", "unsolved"))
        top = heapq.nlargest(self.cfg.hard_examples, hard, key=lambda h: (h.samples, h.uid))
        return [h.entry() for h in top]

    def report(self, step: int) -> dict:
        return {"step": step, "rule": {k: getattr(self.cfg, k) for k in
                                       ("window", "min_samples", "agree_frac", "hard_max_pass_rate",
                                        "suspect_max_pass_rate", "min_source_pass_rate", "source_window")},
                "prompts_seen": len(self.prompts),
                "sources": {name: {"pass_rate": round(sp.rate, 4), "samples": len(sp.recent),
                                   "prompts": sum(h.source == name for h in self.prompts.values())}
                            for name, sp in sorted(self.sources.items())},
                "labels": {k: v for k, v in sorted(self.label_counts.items()) if v},
                "suspects": self.suspects(), "hard_kept_off": self.hard_kept_off(),
                "points": self.points()}

    def points(self) -> list[list]:
        """``[uid, label, recent pass rate, agreement]`` of labelled prompts (see ``points_max``)."""
        labelled = [h for h in self.prompts.values() if h.label]
        cap = self.cfg.points_max
        if len(labelled) > cap:
            first = [h for h in labelled if h.label in (SUSPECT, "hard", "unsolved")][:cap]
            rest = [h for h in labelled if h.label not in (SUSPECT, "hard", "unsolved")]
            labelled = first + rest[:: max(1, len(rest) // max(1, cap - len(first)))][: cap - len(first)]
        return [[h.uid, h.label, round(sum(c for c, _ in h.recent) / len(h.recent), 4), round(h.agreement, 4)]
                for h in labelled]

    def write(self, path: str | Path, step: int) -> Path:
        """The current list as JSON, replaced atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report(step), ensure_ascii=False))
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"prompts": [[h.uid, h.ground_truth, h.prompt, h.source, [[int(c), a] for c, a in h.recent],
                             h.samples, h.correct, h.visits, h.first_step, h.last_step, h.label,
                             h.flagged_since, h.majority_answer, h.agreement]
                            for h in self.prompts.values()],
                "sources": {name: [int(c) for c in sp.recent] for name, sp in self.sources.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.clear()
        self.label_counts.clear()
        self.sources = {name: SourcePassRate(self.cfg.source_window, outcomes)
                        for name, outcomes in state.get("sources", {}).items()}
        for (uid, gt, prompt, source, recent, samples, correct, visits, first, last, label, since, major,
             agree) in state.get("prompts", []):
            h = PromptHistory(uid, gt, prompt, source, deque(((bool(c), a) for c, a in recent),
                                                             maxlen=self.cfg.window or None),
                              samples, correct, visits, first, last, label, since, major, agree)
            self.prompts[uid] = h
            if label:
                self.label_counts[label] += 1
