"""Rollout dumps: every GRPO step's samples as one parquet file under ``RUN_DIR/rollouts/``.

One row per sample (:data:`SCHEMA` says what each column holds). A file per step, named by the global
step and written to a temporary name first, so a crashed step leaves no half file and a resumed run
that redoes a step replaces it. ``sample_rate`` keeps whole groups of a fixed share of the prompts
(picked by a hash of the prompt id, so the same prompts are followed from step to step); ``max_gb``
stops dumping once the directory holds that much (counted, with one warning). A few samples per step
also go to W&B as a table. ``megatron-rl analyze`` reads these files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.tracking.config import RolloutDumpConfig  # noqa: F401  (the dumper's config, declared with the rest)

log = logging.getLogger("megatron_rl")

DIR_NAME = "rollouts"

# Column -> (arrow type, meaning). The trainer fills them; analysis reads them by these names.
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "grpo_step": (pa.int32(), "GRPO step, counted over all stages from 1 (the report's x axis)"),
    "global_step": (pa.int32(), "the run's step counter (SFT steps included)"),
    "stage": (pa.string(), "stage name"),
    "stage_step": (pa.int32(), "step within the stage, from 1"),
    "max_response_len": (pa.int32(), "the stage's max response length"),
    "group": (pa.int32(), "index of the prompt within the step"),
    "sample": (pa.int32(), "index of the sample within its group"),
    "prompt_uid": (pa.string(), "the prompt's id (extra_info.uid, or file:row)"),
    "data_source": (pa.string(), "the prompt's data source (its kind of problem)"),
    "prompt": (pa.string(), "prompt text (chat template applied)"),
    "ground_truth": (pa.string(), "the label"),
    "response": (pa.string(), "response text"),
    "prompt_ids": (pa.list_(pa.int32()), "prompt token ids (empty with token_ids: false)"),
    "response_ids": (pa.list_(pa.int32()), "response token ids (empty with token_ids: false)"),
    "reward": (pa.float32(), "reward"),
    "outcome": (pa.string(), "correct / wrong / unparsable / error / timeout"),
    "answer": (pa.string(), "the answer the verifier extracted (null: none)"),
    "correct": (pa.bool_(), "reward >= algo.correct_reward"),
    "response_len": (pa.int32(), "response tokens"),
    "truncated": (pa.bool_(), "hit the max length without an end-of-sequence token"),
    "finish_reason": (pa.string(), "the engine's finish reason"),
    "weight_version": (pa.int32(), "weights the engine sampled this response with"),
    "advantage": (pa.float32(), "GRPO advantage"),
    "in_batch": (pa.bool_(), "trained on (false: its group had zero reward variance)"),
    "rollout_logp_mean": (pa.float32(), "mean sampled-token log-prob under the engine"),
    "rollout_logp_min": (pa.float32(), "lowest sampled-token log-prob under the engine"),
    "token_prob_mean": (pa.float32(), "mean sampled-token probability under the engine"),
    "entropy_mean": (pa.float32(), "mean per-token entropy under the trainer (null: not trained on)"),
    "entropy_max": (pa.float32(), "highest per-token entropy under the trainer"),
    "train_logp_mean": (pa.float32(), "mean sampled-token log-prob under the trainer, before the update"),
    "logp_gap_mean": (pa.float32(), "mean |trainer - engine| sampled-token log-prob"),
    "logp_gap_max": (pa.float32(), "largest |trainer - engine| sampled-token log-prob"),
    # multi-turn trajectories (prompts with an environment, megatron_rl.envs); a single-turn response
    # is one assistant message
    "env": (pa.string(), "the prompt's environment (null: single-turn)"),
    "turns": (pa.int32(), "model turns"),
    "tool_calls": (pa.int32(), "tool calls run"),
    "tool_errors": (pa.int32(), "tool calls that failed or timed out"),
    "observation_tokens": (pa.int32(), "response tokens that are tool observations (never trained on)"),
    "messages": (pa.list_(pa.struct([("role", pa.string()), ("text", pa.string()), ("tokens", pa.int32())])),
                 "the response turn by turn: assistant turns and tool observations, with their tokens"),
}
SCHEMA = pa.schema([(name, tp) for name, (tp, _) in COLUMNS.items()])
# What the W&B table shows of a sample.
TABLE_COLUMNS = ["grpo_step", "stage", "prompt_uid", "prompt", "response", "ground_truth", "answer",
                 "reward", "advantage", "response_len", "truncated", "token_prob_mean", "entropy_mean"]


def keep_prompt(uid: str, sample_rate: float) -> bool:
    """Whether ``uid``'s groups are dumped: a hash of the id, so the choice is the same every step."""
    if sample_rate >= 1.0:
        return True
    h = int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "little")
    return h / 2**64 < sample_rate


def step_path(run_dir: str | Path, global_step: int) -> Path:
    return Path(run_dir) / DIR_NAME / f"step_{global_step:08d}.parquet"


class RolloutDumper:
    """Writes one step's columns (``dict[name, list]``, one entry per sample) as a parquet file."""

    def __init__(self, cfg: RolloutDumpConfig, run_dir: str | Path):
        self.cfg = cfg
        self.dir = Path(run_dir) / DIR_NAME
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bytes = sum(p.stat().st_size for p in self.dir.glob("step_*.parquet"))
        self.capped = False

    def forget_after(self, global_step: int) -> int:
        """Delete the dumps of steps after ``global_step`` (a run resumed from an earlier checkpoint
        redoes them: they would describe steps of a past that did not happen); returns how many."""
        gone = 0
        for p in self.dir.glob("step_*.parquet"):
            try:
                step = int(p.stem.split("_", 1)[1])
            except ValueError:
                continue
            if step > global_step:
                self.bytes -= p.stat().st_size
                p.unlink()
                gone += 1
        return gone

    def write(self, global_step: int, columns: dict[str, list]) -> dict:
        """Write the rows of kept prompts; returns ``dump/*`` metrics."""
        t0 = time.perf_counter()
        cap = self.cfg.max_gb * 2**30
        if cap and self.bytes >= cap:
            if not self.capped:
                log.warning("rollout dumps reached tracking.rollouts.max_gb=%s in %s: no more dumps",
                            self.cfg.max_gb, self.dir)
            self.capped = True
            return {"dump/capped": 1.0, "dump/rows": 0.0}
        missing = [name for name in COLUMNS if name not in columns]
        if missing:
            raise ValueError(f"rollout dump: columns missing: {missing}")
        n = len(columns["prompt_uid"])
        keep = [i for i, uid in enumerate(columns["prompt_uid"]) if keep_prompt(uid, self.cfg.sample_rate)]
        if len(keep) < n:
            columns = {k: [v[i] for i in keep] for k, v in columns.items()}
        if not self.cfg.token_ids:
            columns = dict(columns, prompt_ids=[[]] * len(keep), response_ids=[[]] * len(keep))
        table = pa.Table.from_pydict({k: columns[k] for k in COLUMNS}, schema=SCHEMA)
        path = step_path(self.dir.parent, global_step)
        tmp = path.with_suffix(".tmp")
        old = path.stat().st_size if path.exists() else 0
        pq.write_table(table, tmp, compression="zstd")
        size = tmp.stat().st_size
        os.replace(tmp, path)
        self.bytes += size - old
        return {"dump/rows": float(len(keep)), "dump/bytes": float(size), "dump/total_gb": self.bytes / 2**30,
                "dump/capped": 0.0, "dump/write_seconds": time.perf_counter() - t0}


def table_rows(columns: dict[str, list], n: int) -> list[list]:
    """``n`` samples for the W&B table, spread over the step's groups (first sample of each)."""
    total = len(columns["prompt_uid"])
    if not n or not total:
        return []
    firsts = [i for i in range(total) if columns["sample"][i] == 0] or list(range(total))
    picks = firsts[:: max(1, len(firsts) // n)][:n]
    return [[columns[c][i] for c in TABLE_COLUMNS] for i in picks]


def read_rollouts(run_dir: str | Path, columns: list[str] | None = None):
    """All dumped steps as one pandas DataFrame (a redone step's file replaced the first one)."""
    files = sorted((Path(run_dir) / DIR_NAME).glob("step_*.parquet"))
    if not files:
        return None
    return pq.ParquetDataset(files).read(columns=columns).to_pandas()
