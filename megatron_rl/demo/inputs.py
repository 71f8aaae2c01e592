"""The demo's inputs in the run directory: the tiny model and the synthetic task's data.

Called once by the entry point on global rank 0, before the trainer is built; idempotent (what
exists is kept, so a resumed run trains on the same model and problems).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_rl.demo.config import SyntheticConfig, TinySpec
from megatron_rl.data.wrong_labels import PLANTED_FILE
from megatron_rl.demo.synthetic import TASKS, data_source, held_out_kind, plant, sample_problems, write_dataset
from megatron_rl.demo.tiny import write_tiny_model

# Where the inputs go, under the run directory.
TINY_MODEL_DIR = "base_model"
DATA_DIR = "data"


def tiny_model_dir(run_root: str | Path) -> Path:
    return Path(run_root) / TINY_MODEL_DIR


def prepare_inputs(run_root: str | Path, *, tiny: TinySpec | None, synthetic: SyntheticConfig,
                   seed: int) -> None:
    """Write the tiny model (when ``tiny`` is given) and the synthetic data (when enabled).

    ``seed`` (the run's ``trainer.seed``) seeds the model when ``tiny.seed`` is null, and the problems.
    """
    out = tiny_model_dir(run_root)
    if tiny is not None and not (out / "config.json").exists():
        write_tiny_model(out, tiny if tiny.seed is not None else dataclasses.replace(tiny, seed=seed))
    if synthetic.enabled:
        data_dir = Path(run_root) / DATA_DIR
        if not (data_dir / "eval.jsonl").exists():
            write_synthetic(data_dir, synthetic, seed)


def write_synthetic(data_dir: Path, synthetic: SyntheticConfig, seed: int) -> None:
    """train.jsonl (with planted labels when asked, listed in planted.json), sft.jsonl, eval.jsonl."""
    kw = dict(min_digits=synthetic.min_digits, max_digits=synthetic.max_digits, op=TASKS[synthetic.task])
    source, env = data_source(synthetic.task), synthetic.env
    problems = sample_problems(synthetic.train_size + synthetic.sft_size, seed, "train", **kw)
    train, sft = problems[: synthetic.train_size], problems[synthetic.train_size:]
    labels: dict[int, str] = {}
    sources: dict[int, str] = {}
    if synthetic.wrong_label_fraction or synthetic.hard_fraction:
        train, labels, rows = plant(train, seed, synthetic.wrong_label_fraction, synthetic.hard_fraction,
                                    synthetic.max_digits)
        sources = {i: held_out_kind(synthetic.max_digits, source) for i in rows["hard"]}
        planted = {kind: [f"train-{i}" for i in idx] for kind, idx in rows.items()}
        (data_dir.parent / PLANTED_FILE).parent.mkdir(parents=True, exist_ok=True)
        (data_dir.parent / PLANTED_FILE).write_text(json.dumps(planted, indent=1))
    write_dataset(data_dir / "train.jsonl", train, "train", labels, sources, source=source, env=env)
    if sft:
        write_dataset(data_dir / "sft.jsonl", sft, "sft", source=source, env=env)
    write_dataset(data_dir / "eval.jsonl", sample_problems(synthetic.eval_size, seed, "eval", **kw), "eval",
                  source=source, env=env)
