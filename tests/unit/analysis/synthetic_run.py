"""A run directory written by the real writers (Tracker, RolloutDumper, WrongLabelMonitor) from a
simulated policy, for the analysis tests. No model, no engine: the numbers are drawn, the files are
the real thing.

The simulated policy learns addition: prompt p answers right with probability ``skill_p(step)``
(rising); a wrong sample gives one of a few near-misses (scattered). Planted wrong labels keep the
true sum as the policy's answer while the label is off by 7: the policy agrees with itself, the label
never matches. Hard prompts are rarely right and scatter widely.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from megatron_rl.tracking import TrackingConfig, Tracker
from megatron_rl.tracking.rollouts import RolloutDumpConfig, RolloutDumper
from megatron_rl.data.wrong_labels import FILE_NAME, PLANTED_FILE, WrongLabelConfig, WrongLabelMonitor

STAGES = [("stage1_12", 12, 10), ("stage2_16", 16, 8), ("stage3_24", 24, 6)]


def make_run(root: Path, *, prompts: int = 200, batch: int = 40, group: int = 8, planted: int = 10,
             hard: int = 10, seed: int = 0, sft_steps: int = 30, moe_layers: int = 2,
             dump_cfg: RolloutDumpConfig | None = None,
             monitor_cfg: WrongLabelConfig | None = None, text=None) -> dict:
    """Write ``root`` as a finished run; returns what was simulated (for independent checks).
    ``moe_layers``: a Mixture-of-Experts policy's per-layer expert-load metrics (0: a dense one).

    ``text(field, value)``, when given, rewrites every text the run holds (``field``: stage,
    uid, source, prompt, label, response, answer) before it is written (the report's markup tests
    plant HTML with it)."""
    text = text or (lambda field, value: value)
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    uids = [text("uid", f"train-{i}") for i in range(prompts)]
    kind = {u: "normal" for u in uids}
    for u in rng.sample(uids, planted + hard)[:planted]:
        kind[u] = "wrong_label"
    for u in [u for u in uids if kind[u] == "normal"][:hard]:
        kind[u] = "hard"
    true = {u: (rng.randint(10, 999), rng.randint(10, 999)) for u in uids}
    label = {u: text("label", str(sum(true[u]) + (7 if kind[u] == "wrong_label" else 0))) for u in uids}
    base = {u: (-4.5 if kind[u] == "hard" else rng.uniform(-2.0, 1.0)) for u in uids}
    (root / PLANTED_FILE).parent.mkdir(parents=True, exist_ok=True)
    (root / PLANTED_FILE).write_text(json.dumps({
        "wrong_label": [u for u in uids if kind[u] == "wrong_label"],
        "hard": [u for u in uids if kind[u] == "hard"]}))

    tracker = Tracker(TrackingConfig(wandb_mode="disabled", console=False), root, {})
    for s in range(1, sft_steps + 1):
        tracker.log({"sft/nll": 1.0 / s}, step=s, stage="sft")
    dumper = RolloutDumper(dump_cfg or RolloutDumpConfig(), root)
    monitor = WrongLabelMonitor(monitor_cfg or WrongLabelConfig(window=32, min_samples=16, min_source_pass_rate=0.3))
    order = []
    grpo = 0
    global_step = sft_steps
    for stage, max_len, steps in STAGES:
        stage = text("stage", stage)
        for stage_step in range(1, steps + 1):
            grpo += 1
            global_step += 1
            while len(order) < batch:
                perm = uids[:]
                rng.shuffle(perm)
                order += perm
            step_uids, order = order[:batch], order[batch:]
            cols: dict[str, list] = {k: [] for k in (
                "grpo_step", "global_step", "stage", "stage_step", "max_response_len", "group", "sample",
                "prompt_uid", "data_source", "prompt", "ground_truth", "response", "prompt_ids", "response_ids", "reward",
                "outcome", "answer", "correct", "response_len", "truncated", "finish_reason",
                "weight_version", "advantage", "in_batch", "rollout_logp_mean", "rollout_logp_min",
                "token_prob_mean", "entropy_mean", "entropy_max", "train_logp_mean", "logp_gap_mean",
                "logp_gap_max")}
            groups = []
            t_gen = rng.uniform(1.0, 1.5)
            for g, u in enumerate(step_uids):
                skill = 1 / (1 + math.exp(-(base[u] + 0.15 * grpo)))
                a, b = true[u]
                answers, correct = [], []
                for _ in range(group):
                    if rng.random() < skill:
                        ans = str(a + b)
                    elif kind[u] == "hard":
                        ans = str(rng.randint(100, 1999))
                    else:
                        ans = str(a + b + rng.choice([-100, -10, -1, 1, 10, 100, 11, -11]))
                    correct.append(ans == str(sum(true[u]) + (7 if kind[u] == "wrong_label" else 0)))
                    answers.append(text("answer", ans))
                rewards = [1.0 if c else 0.0 for c in correct]
                mean = sum(rewards) / group
                std = (sum((r - mean) ** 2 for r in rewards) / group) ** 0.5
                in_batch = std > 0
                source = text("source", "sim/hard" if kind[u] == "hard" else "sim/addition")
                prompt = text("prompt", f"{a}+{b}=")
                groups.append((u, label[u], prompt, source, correct, answers))
                for i, (ans, c) in enumerate(zip(answers, correct)):
                    adv = (rewards[i] - mean) / (std + 1e-6) if in_batch else 0.0
                    resp = text("response", f"\\boxed{{{ans}}}")
                    n = len(resp) + 1
                    truncated = n > max_len
                    ent = rng.uniform(0.05, 0.3) if c else rng.uniform(0.3, 0.9)
                    lp = -rng.uniform(0.01, 0.2) if c else -rng.uniform(0.3, 1.2)
                    row = dict(grpo_step=grpo, global_step=global_step, stage=stage, stage_step=stage_step,
                               max_response_len=max_len, group=g, sample=i, prompt_uid=u, data_source=source,
                               prompt=prompt,
                               ground_truth=label[u], response=resp, prompt_ids=[ord(ch) for ch in f"{a}+{b}="],
                               response_ids=[ord(ch) for ch in resp][:max_len], reward=rewards[i],
                               outcome="correct" if c else "wrong", answer=ans, correct=c,
                               response_len=min(n, max_len), truncated=truncated,
                               finish_reason="length" if truncated else "stop", weight_version=grpo,
                               advantage=adv, in_batch=in_batch, rollout_logp_mean=lp, rollout_logp_min=lp * 2,
                               token_prob_mean=math.exp(lp),
                               entropy_mean=ent if in_batch else None, entropy_max=ent * 2 if in_batch else None,
                               train_logp_mean=lp + 1e-3 if in_batch else None,
                               logp_gap_mean=abs(rng.gauss(0, 2e-3)) if in_batch else None,
                               logp_gap_max=abs(rng.gauss(0, 6e-3)) if in_batch else None)
                    for k, v in row.items():
                        cols[k].append(v)
            n = len(cols["response"])  # single-turn responses: one assistant message each, no tool
            cols.update(env=[None] * n, turns=[1] * n, tool_calls=[0] * n, tool_errors=[0] * n,
                        observation_tokens=[0] * n,
                        messages=[[{"role": "assistant", "text": r, "tokens": k}]
                                  for r, k in zip(cols["response"], cols["response_len"])])
            t0 = time.perf_counter()
            m = dumper.write(global_step, cols)
            m.update(monitor.observe(grpo, groups))
            monitor.write(root / "rollouts" / FILE_NAME, grpo)
            t_dump = time.perf_counter() - t0
            acc = sum(cols["correct"]) / len(cols["correct"])
            parts = {"gen": t_gen, "reward": 0.05, "update": 0.9, "sync": 0.1, "dump": t_dump, "other": 0.02}
            m.update({f"timing/{k}": v for k, v in parts.items()})
            m["timing/step"] = sum(parts.values())
            m.update({"grpo_step": grpo, "rollout/accuracy": acc, "rollout/accuracy_non_truncated": acc,
                      "rollout/truncation_ratio": sum(cols["truncated"]) / len(cols["truncated"]),
                      "rollout/response_length_mean": sum(cols["response_len"]) / len(cols["response_len"]),
                      "actor/entropy": 0.6 - 0.01 * grpo})
            if grpo % 8 == 0:
                m["eval/accuracy"] = acc * 0.9
            for i in range(moe_layers):  # a Mixture-of-Experts policy whose load evens out
                spread = (0.2 + 0.05 * i) / (1 + 0.2 * grpo)
                m[f"moe/load_max/layer_{i}"] = 0.125 + spread
                m[f"moe/load_min/layer_{i}"] = max(0.0, 0.125 - spread / 2)
            if moe_layers:
                m["moe/aux_loss"], m["moe/z_loss"] = 1.0 + 0.5 / grpo, 2.0 + 1.0 / grpo
                # routing replay's diagnostics (algo.router_agreement): agreement rising, replay's gap below
                m["moe/router_agreement"] = 0.9 + 0.05 * grpo / (grpo + 10)
                m["moe/train_infer_logp_gap_free"] = 0.01 / (1 + 0.1 * grpo)
                m["moe/train_infer_logp_gap_replay"] = 0.004 / (1 + 0.1 * grpo)
            tracker.log(m, step=global_step, stage=stage)
    tracker.close()
    (root / "summary.json").write_text(json.dumps({"per_stage": {"start": {"eval/accuracy": 0.25},
                                                                 "stage3_24": {"eval/accuracy": 0.5}}}))
    return {"kind": kind, "label": label, "grpo_steps": grpo, "monitor": monitor}
