"""Data cleaning: tell hard questions from wrong labels, Skywork-style offline filtering.

Sample ``k`` responses per prompt, score them against the label, and label the prompt solved /
mixed / hard / unsolved / suspected_wrong_label with the difficulty rule,
:func:`megatron_rl.data.labels.label_prompt` (the same rule watches a training run's prompts live,
:mod:`megatron_rl.data.wrong_labels`).

The labeller is a pure function; :func:`annotate` runs an engine and the
reward manager over a dataset; :func:`cli_main` is ``megatron-rl data difficulty``. The annotated
dataset is the input with ``extra_info.difficulty = {label, pass_rate, k, n_correct,
majority_wrong_answer, majority_wrong_frac, distinct_wrong_answers}`` added to each labelled row;
training keeps labels / pass-rate ranges via ``data.keep_labels`` / ``data.pass_rate_min|max``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.config.base import ConfigBase, ConfigError, ranged
from megatron_rl.data.config import DataConfig
from megatron_rl.data.dataset import DataError, PromptRecord, load_prompts, read_rows
from megatron_rl.data.labels import DifficultyLabel, canonical_answer, label_prompt  # noqa: F401  (re-exported)
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DifficultyConfig(ConfigBase):
    # Responses sampled per prompt.
    k: int = ranged(8, ge=1)
    temperature: float = ranged(1.0, gt=0.0)
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    top_k: int = ranged(-1, ge=1, also=(-1,))
    # Maximum response length in tokens.
    max_tokens: int = ranged(1024, ge=1)
    seed: int = ranged(0, ge=0)
    # Prompts per engine call.
    batch_prompts: int = ranged(64, ge=1)
    # A response counts as right when its reward is at least this.
    correct_reward: float = ranged(1.0)
    # Pass rates in (0, hard_max_pass_rate] are "hard" (unless the wrong answers agree).
    hard_max_pass_rate: float = ranged(0.25, ge=0.0, le=1.0)
    # Share of all k samples that must give the same wrong answer to suspect the label.
    agree_frac: float = ranged(0.5, gt=0.0, le=1.0)
    # Suspect a label only where the policy's pass rate on the prompt's data source (over the whole
    # dataset) is at least this: a policy that fails at a kind of problem is confidently wrong on
    # it as often as a label is wrong (0: no such check).
    min_source_pass_rate: float = ranged(0.0, ge=0.0, le=1.0)
    # Suspected wrong labels listed in the summary for review (most confident first).
    summary_examples: int = ranged(50, ge=0)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def annotate(engine, records: list[PromptRecord], reward_mgr, cfg: DifficultyConfig
             ) -> list[DifficultyLabel]:
    """Sample ``cfg.k`` responses per record, score them, label each record."""
    from megatron_rl.rollout.base import SamplingSpec
    from megatron_rl.trainer.phases import reward_item

    spec = SamplingSpec(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        max_tokens=cfg.max_tokens, seed=cfg.seed)
    samples: list[tuple[list[bool], list]] = []  # per record: correct, extracted answers
    for start in range(0, len(records), cfg.batch_prompts):
        chunk = records[start: start + cfg.batch_prompts]
        groups = engine.generate([r.prompt_ids for r in chunk], spec)
        items = [reward_item(r, c.text) for r, group in zip(chunk, groups) for c in group]
        scores, _, details = reward_mgr.score(items, return_details=True)
        for j in range(len(groups)):
            lo, hi = j * cfg.k, (j + 1) * cfg.k
            samples.append(([s >= cfg.correct_reward for s in scores[lo:hi]],
                            [d["extracted"] for d in details[lo:hi]]))
        log.info("difficulty: %d/%d prompts sampled", len(samples), len(records))
    # The policy's pass rate per data source, over the whole dataset: the rule's competence check.
    right, total = Counter(), Counter()
    for rec, (correct, _) in zip(records, samples):
        right[rec.data_source] += sum(correct)
        total[rec.data_source] += len(correct)
    return [label_prompt(correct, answers, ground_truth=rec.ground_truth,
                         hard_max_pass_rate=cfg.hard_max_pass_rate, agree_frac=cfg.agree_frac,
                         source_pass_rate=right[rec.data_source] / total[rec.data_source],
                         min_source_pass_rate=cfg.min_source_pass_rate)
            for rec, (correct, answers) in zip(records, samples)]


def summarize(records: list[PromptRecord], labels: list[DifficultyLabel], cfg: DifficultyConfig,
              extra: dict | None = None) -> dict:
    counts = Counter(lab.label for lab in labels)
    suspects = sorted(((lab, rec) for lab, rec in zip(labels, records)
                       if lab.label == "suspected_wrong_label"),
                      key=lambda p: -p[0].majority_wrong_frac)
    return {
        "prompts": len(labels),
        "k": cfg.k,
        "labels": {name: counts.get(name, 0) for name in
                   ("solved", "mixed", "hard", "unsolved", "suspected_wrong_label")},
        "pass_rate_mean": sum(lab.pass_rate for lab in labels) / max(len(labels), 1),
        "pass_rate_histogram": dict(sorted(Counter(round(lab.pass_rate, 3) for lab in labels).items())),
        "suspected_wrong_label_examples": [
            {"uid": rec.uid, "ground_truth": rec.ground_truth,
             "majority_answer": lab.majority_wrong_answer, "agreement": lab.majority_wrong_frac,
             "pass_rate": lab.pass_rate, "prompt": rec.prompt_text[:500]}
            for lab, rec in suspects[: cfg.summary_examples]],
        **(extra or {}),
    }


def write_annotated(src: str | Path, dst: str | Path, records: list[PromptRecord],
                    labels: list[DifficultyLabel], extra_key: str = "extra_info") -> int:
    """Copy ``src`` to ``dst`` (same format by suffix) adding the annotation to labelled rows.

    Rows are matched by their row number (``PromptRecord.row``); rows that were not labelled (too
    long, malformed and skipped) are copied without an annotation. Returns the rows written.
    """
    by_row = {rec.row: asdict(lab) for rec, lab in zip(records, labels)}
    rows = []
    for rowno, row in read_rows(src):
        if not isinstance(row, dict):
            continue  # malformed rows were skipped by the loader too
        if rowno in by_row:
            row = dict(row)
            row[extra_key] = dict(row.get(extra_key) or {}, difficulty=by_row[rowno])
        rows.append(row)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), dst)
    elif dst.suffix in (".jsonl", ".ndjson"):
        with dst.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise DataError(f"{dst}: write .jsonl or .parquet")
    return len(rows)


def check_fits(need: int, model_path: str, what: str) -> None:
    """The engine is sized for the longest prompt + ``max_tokens``: refuse (naming ``max_tokens``,
    the file and the row) a length the model's positions cannot hold, before the engine starts."""
    from megatron_rl.models.hf_config import read_hf_config

    limit = read_hf_config(model_path).max_position_embeddings
    if need > limit:
        raise ConfigError("max_tokens", f"{what} = {need} exceeds the model's max_position_embeddings "
                                        f"({limit}, {Path(model_path) / 'config.json'}): lower max_tokens, "
                                        f"or drop long prompts with data.max_prompt_len")


def check_writable(path: Path, option: str) -> None:
    """``path`` can be written: its directory made (or there), the file itself none or a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{path} ({option}): cannot create its directory: {exc.strerror or exc}") from None
    if path.is_dir():
        raise DataError(f"{path} ({option}): is a directory, not a file")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise DataError(f"{path} ({option}): cannot write there: Permission denied")


def run(data_path: str, model_path: str, out_path: str, summary_path: str | None,
        cfg: DifficultyConfig, engine=None) -> dict:
    """Label a dataset end to end; ``engine`` defaults to ``make_engine(model_path, cfg.rollout)``."""
    from transformers import AutoTokenizer

    from megatron_rl.rewards import RewardManager, check_reward_styles

    cfg.validate()
    for what, path in (("data", data_path), ("model", model_path)):
        if not Path(path).exists():
            raise DataError(f"{what}: no such file or directory: {path}")
    if Path(out_path).suffix not in (".parquet", ".jsonl", ".ndjson"):
        raise DataError(f"{out_path}: the annotated copy is written as .jsonl or .parquet")
    summary_path = summary_path or str(Path(out_path).with_suffix("")) + ".summary.json"
    for option, path in (("--out", out_path), ("--summary", summary_path)):
        check_writable(Path(path), option)  # before the engine runs, not after
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records, stats = load_prompts(data_path, tokenizer, cfg.data)
    check_reward_styles(cfg.reward, records, str(data_path))  # each row scores, before the engine starts
    own_engine = engine is None
    if own_engine:
        from megatron_rl.rollout import make_engine

        longest = max(records, key=lambda r: len(r.prompt_ids))
        max_len = len(longest.prompt_ids) + cfg.max_tokens
        check_fits(max_len, model_path, f"{data_path}: row {longest.row}: the longest prompt "
                                        f"({len(longest.prompt_ids)} tokens) + max_tokens ({cfg.max_tokens})")
        engine = make_engine(model_path, cfg.rollout, seed=cfg.seed, max_model_len=max_len)
    try:
        with RewardManager(cfg.reward) as mgr:
            labels = annotate(engine, records, mgr, cfg)
    finally:
        if own_engine:
            engine.close()
    written = write_annotated(data_path, out_path, records, labels, cfg.data.extra_key)
    summary = summarize(records, labels, cfg, {"data": str(data_path), "model": str(model_path),
                                               "load_stats": stats, "rows_written": written,
                                               "seconds": time.monotonic() - t0})
    Path(summary_path).write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    log.info("difficulty: %s -> %s (%s)", data_path, out_path, summary["labels"])
    return summary


def cli_main(argv: list[str]) -> int:
    """``megatron-rl data difficulty --data D --model M --out O [--config C.yaml] [key=value ...]``.

    Keys are those of :class:`DifficultyConfig` (``k=16``, ``reward.style_map={rule: math}``,
    ``rollout.kv_cache_bytes=...``); a YAML ``--config`` holds the same tree.
    """
    from megatron_rl.config.loader import load

    from megatron_rl.common.cli_args import ArgumentParser

    p = ArgumentParser(prog="megatron-rl data difficulty",
                                description="label prompts solved / mixed / hard / unsolved / "
                                            "suspected_wrong_label by sampling k responses")
    p.add_argument("--data", required=True, help="input dataset (.jsonl / .json / .parquet)")
    p.add_argument("--model", required=True, help="HF model directory for the engine and tokenizer")
    p.add_argument("--out", required=True, help="annotated dataset to write (.jsonl / .parquet)")
    p.add_argument("--summary", default=None, help="summary JSON (default: OUT without suffix "
                                                    "+ .summary.json)")
    p.add_argument("--config", default=None, help="YAML with DifficultyConfig keys")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    argv = list(argv)
    if argv[:1] == ["--"]:  # `megatron-rl data difficulty -- --data ...` passes the separator on
        argv = argv[1:]
    args = p.parse_args(argv)
    cfg = load(DifficultyConfig, args.config, args.overrides)
    summary = run(args.data, args.model, args.out, args.summary, cfg)
    print(json.dumps({"labels": summary["labels"], "pass_rate_mean": summary["pass_rate_mean"]}))
    return 0
