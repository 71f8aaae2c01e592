"""What the run records about each step's samples: the rollout dump, the W&B sample table and the
live wrong-label monitor (driver only; timed as the step's ``dump`` part).

The per-sample training values (entropy, the trainer's log-probs and their gap to the engine's)
come from the update's forward (:data:`phases.SAMPLE_STATS`); samples whose group was filtered out
were not trained on and have none.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_rl.data.wrong_labels import FILE_NAME as WRONG_LABELS_FILE
from megatron_rl.data.wrong_labels import WrongLabelMonitor
from megatron_rl.tracking import Tracker
from megatron_rl.tracking.rollouts import DIR_NAME, TABLE_COLUMNS, RolloutDumper, table_rows
from megatron_rl.trainer.phases import SAMPLE_STATS, Rollout


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def dump_columns(ro: Rollout, per_sample: dict[str, torch.Tensor] | None, *, correct_reward: float,
                 grpo_step: int, global_step: int, stage: str, stage_step: int,
                 max_response_len: int) -> dict[str, list]:
    """One entry per completion for every column of :data:`tracking.rollouts.COLUMNS`."""
    n = len(ro.completions)
    gids = ro.group_ids.tolist()
    in_batch = [False] * n
    stats = {k: [None] * n for k in SAMPLE_STATS}
    values = {k: v.tolist() for k, v in per_sample.items()} if per_sample is not None else None
    for pos, i in enumerate(ro.batch_index or []):
        in_batch[i] = True
        if values is not None:
            for k in SAMPLE_STATS:
                stats[k][i] = _num(values[k][pos])
    sample = []
    for i, g in enumerate(gids):
        sample.append(0 if i == 0 or gids[i - 1] != g else sample[-1] + 1)
    cols: dict[str, list] = {
        "grpo_step": [grpo_step] * n, "global_step": [global_step] * n, "stage": [stage] * n,
        "stage_step": [stage_step] * n, "max_response_len": [max_response_len] * n,
        "group": gids, "sample": sample,
    }
    recs = [ro.records[g] for g in gids]
    cols["prompt_uid"] = [r.uid for r in recs]
    cols["data_source"] = [r.data_source for r in recs]
    cols["prompt"] = [r.prompt_text for r in recs]
    cols["ground_truth"] = [str(r.ground_truth) for r in recs]
    cols["prompt_ids"] = [list(r.prompt_ids) for r in recs]
    comps = ro.completions
    cols["response"] = [c.text for c in comps]
    cols["response_ids"] = [list(c.token_ids) for c in comps]
    rewards = ro.rewards.tolist()
    cols["reward"] = rewards
    outcomes = ro.outcomes or [{}] * n
    cols["outcome"] = [o.get("status") for o in outcomes]
    cols["answer"] = [None if o.get("extracted") is None else str(o.get("extracted")) for o in outcomes]
    cols["correct"] = [r >= correct_reward for r in rewards]
    cols["response_len"] = [len(c.token_ids) for c in comps]
    cols["truncated"] = [bool(c.truncated) for c in comps]
    cols["finish_reason"] = [c.finish_reason for c in comps]
    cols["weight_version"] = [int(c.weight_version) for c in comps]
    cols["advantage"] = ro.advantages.tolist() if ro.advantages is not None else [None] * n
    cols["in_batch"] = in_batch
    lp_mean, lp_min, p_mean = [], [], []
    for c in comps:  # plain floats: a few dozen tokens each, cheaper than a tensor per response
        lp = [x for x, mine in zip(c.logprobs, c.model_tokens()) if mine]  # tool observations have none
        lp_mean.append(math.fsum(lp) / len(lp) if lp else None)
        lp_min.append(min(lp) if lp else None)
        p_mean.append(math.fsum(math.exp(x) for x in lp) / len(lp) if lp else None)
    cols["rollout_logp_mean"], cols["rollout_logp_min"], cols["token_prob_mean"] = lp_mean, lp_min, p_mean
    cols.update(stats)
    cols.update(episode_columns(comps))
    return cols


def episode_columns(comps) -> dict[str, list]:
    """The multi-turn columns: a trajectory's environment, turns and tool calls (a single-turn
    response: one assistant message, no tool)."""
    eps = [c.extra.get("episode") for c in comps]
    return {
        "env": [None if e is None else e["env"] for e in eps],
        "turns": [1 if e is None else e["turns"] for e in eps],
        "tool_calls": [0 if e is None else e["tool_calls"] for e in eps],
        "tool_errors": [0 if e is None else e["tool_errors"] for e in eps],
        "observation_tokens": [0 if e is None else e["observation_tokens"] for e in eps],
        "messages": [[{"role": "assistant", "text": c.text, "tokens": len(c.token_ids)}] if e is None else
                     [{"role": m["role"], "text": m["text"], "tokens": m["tokens"]} for m in e["messages"]]
                     for c, e in zip(comps, eps)],
    }


def monitor_groups(cols: dict[str, list]):
    """The step's groups as the wrong-label monitor takes them."""
    groups: dict[int, tuple] = {}
    for i, g in enumerate(cols["group"]):
        if g not in groups:
            groups[g] = (cols["prompt_uid"][i], cols["ground_truth"][i], cols["prompt"][i],
                         cols["data_source"][i], [], [])
        groups[g][4].append(cols["correct"][i])
        groups[g][5].append(cols["answer"][i])
    return list(groups.values())


class StepObserver:
    """Dump, table and monitor of one run (on the driver); ``observe`` after each GRPO step."""

    def __init__(self, run_root: str | Path, dumper: RolloutDumper | None, monitor: WrongLabelMonitor | None,
                 tracker: Tracker | None, table_samples: int):
        self.root = Path(run_root)
        self.dumper, self.monitor, self.tracker = dumper, monitor, tracker
        self.table_samples = table_samples
        self._step: int | None = None

    def observe(self, ro: Rollout, per_sample, *, correct_reward: float, grpo_step: int, global_step: int,
                stage: str, stage_step: int, max_response_len: int) -> dict:
        if self.dumper is None and self.monitor is None:
            return {}
        cols = dump_columns(ro, per_sample, correct_reward=correct_reward, grpo_step=grpo_step,
                            global_step=global_step, stage=stage, stage_step=stage_step,
                            max_response_len=max_response_len)
        metrics: dict = {}
        if self.dumper is not None:
            metrics.update(self.dumper.write(global_step, cols))
            if self.tracker is not None and self.table_samples:
                self.tracker.log_table("rollouts/samples", TABLE_COLUMNS, table_rows(cols, self.table_samples),
                                       step=global_step)
        if self.monitor is not None:
            metrics.update(self.monitor.observe(grpo_step, monitor_groups(cols)))
            self._step = grpo_step
            if grpo_step % self.monitor.cfg.write_every == 0:
                self.flush()
        return metrics

    def flush(self) -> None:
        """Write the wrong-label list as it stands (every ``write_every`` steps and at stage ends)."""
        if self.monitor is not None and self._step is not None:
            self.monitor.write(self.root / DIR_NAME / WRONG_LABELS_FILE, self._step)
