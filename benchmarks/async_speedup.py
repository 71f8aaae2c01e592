"""Asynchronous GRPO vs synchronous on the CPU demo: wall time and held-out accuracy, in one run.

From the demo's SFT cold start (made once, reused from ``--work``), the demo's first GRPO stage
(64 prompts x 8 samples, max response 12 tokens) runs ``--steps`` steps

- ``inproc``: the simplest loop, the engine in the trainer's process (``rollout.engine=vllm``,
  the demo's own setting) and ``max_staleness=0``: generate, train, sync in turn on one core,
- ``sync``:  ``rollout.async.max_staleness=0`` on a vLLM server (generate, train, sync in turn),
- ``async``: ``rollout.async.max_staleness=1`` on a vLLM server (one-step-off: the next wave
  generates while the trainer trains),

for seed pairs 1, 2, ... (data order and sampling seeds; same SFT checkpoint, same data and held-out
set) until the 95 % interval of the mean paired gap (async - sync held-out accuracy, Student t over
the pairs; a seed without a ``sync`` run pairs with its ``inproc`` run, the same synchronous loop on
the same samples: ``--modes inproc async`` makes the cheaper pairs) is narrower than ``--ci-points`` (2 points) with at least ``--min-pairs`` pairs, or
``--max-pairs`` / the budget (``--budget-s``) ends; every mode with the same objective (``--algo``,
default TIS: stale samples need it, and it costs the synchronous run an old-log-prob pass when it
takes several optimizer steps; e.g. ``algo.policy_loss=decoupled_ppo`` for AReaL's decoupled
objective). Finished runs are kept per objective (``--work``/<objective tag>/), so another objective
never reuses them. The trainer process computes on core 0 and the engine (a vLLM server the trainer
starts: ``vllm_server``, colocated, gloo sync), the reward workers and the fleet client's thread on
core 1 (``trainer.cpu_cores=[0]``), one thread each; the in-process loop has its engine on core 0 too
(its reward workers on core 1). Prints, per run, the GRPO wall time (the steps' summed ``timing/step``),
the greedy held-out accuracy after the stage (``--eval-size`` problems, 2000 by default; also for the SFT
weights themselves), the mean of the last three evaluations, and
the step's time split; then the ratios: async vs sync (ours vs naive), the physical floor of
one-step-off, max(generation + reward, old log-probs + update) + sync per step, from the sync runs'
own split, and (estimated from that split) async vs a synchronous loop that skips the old-log-prob
pass (no TIS); and async vs the in-process loop (``wall_ratio_vs_inproc``, target <= 0.8, and the
accuracies). The last line is one JSON object: ``{"wall_ratio", "accuracy_sync",
"accuracy_async", "paired_gap_mean_points", "paired_gap_ci95_points", "settled", "objective",
"wall_ratio_vs_inproc", ...}`` (medians over seeds; the paired gap's mean and interval over the
finished pairs, for the final evaluation and for the mean of the last three).

    python benchmarks/async_speedup.py [--steps 100] [--min-pairs 6] [--max-pairs 12] [--budget-s 3600]
        [--algo algo.policy_loss=decoupled_ppo] [--work runs/bench_async]

The SFT checkpoint and every finished run are kept in ``--work`` and reused, so the script can be
run in pieces (``--seeds 1``, then ``--seeds 1 2``). The box is shared: the load average is printed
before and after and per run; read the ratios within one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the final-weights check reads the held-out set and scores with the project's code
CONFIG = REPO / "configs" / "demo_cpu.yaml"
STAGE = "stage1_12"
STAGE_MAX_TOKENS = 12  # the stage's max_response_len (configs/demo_cpu.yaml): the evaluation's budget
# The engine in its own process: one vLLM server, started by the trainer, weights over gloo.
SERVER = ["rollout.engine=vllm_server", "rollout.placement=colocated", "sync.transport=gloo",
          "sync.bucket_bytes=16777216"]
# The trainer on core 0; the server, the reward workers and the fleet client on core 1.
PLACEMENT = ["trainer.cpu_cores=[0]"]
# Each mode's engine and loop.
MODES = {
    "inproc": ["rollout.engine=vllm", "sync.transport=inprocess", "rollout.async.max_staleness=0"],
    "sync": [*SERVER, "rollout.async.max_staleness=0"],
    "async": [*SERVER, "rollout.async.max_staleness=1"],
}


class Budget:
    """``--budget-s``: start a run only if it should finish within the budget (from the longest
    finished run of its kind, kept in ``work``), so one invocation fits a slot on a shared box;
    the next invocation goes on where it stopped."""

    GUESS_S = {"sft": 480.0, "sync": 420.0, "async": 300.0, "inproc": 300.0}

    def __init__(self):
        self.t0 = time.perf_counter()
        self.limit: float | None = None
        self.file: Path | None = None

    def setup(self, work: Path, limit: float | None) -> None:
        self.limit, self.file = limit, work / "bench_process_s.json"

    def _seen(self) -> dict:
        return json.loads(self.file.read_text()) if self.file is not None and self.file.exists() else {}

    def allows(self, kind: str) -> bool:
        if self.limit is None:
            return True
        need = max(self._seen().get(kind, []), default=self.GUESS_S[kind])
        ok = time.perf_counter() - self.t0 + need <= self.limit
        if not ok:
            print(f"  not starting a {kind} run: about {need:.0f} s, {self.limit - (time.perf_counter() - self.t0):.0f} s "
                  f"of --budget-s left", flush=True)
        return ok

    def record(self, kind: str, seconds: float) -> None:
        seen = self._seen()
        seen.setdefault(kind, []).append(round(seconds, 1))
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps(seen))


BUDGET = Budget()

# Two-sided 95 % Student t quantiles, t(0.975, df) for df = 1..30 (1.96 beyond).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


def paired_interval(gaps: list[float]) -> tuple[float, float]:
    """Mean of the paired gaps and the half-width of its 95 % interval (inf below two pairs)."""
    n = len(gaps)
    mean = statistics.mean(gaps) if gaps else float("nan")
    if n < 2:
        return mean, float("inf")
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96
    return mean, t * statistics.stdev(gaps) / n ** 0.5


def objective_tag(algo: list[str]) -> str:
    """A short name of the objective's overrides, for the run directories."""
    import hashlib

    return "tis_token" if algo == ["algo.mismatch.mode=tis_token"] else \
        "obj_" + hashlib.sha1(" ".join(sorted(algo)).encode()).hexdigest()[:8]


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", WANDB_MODE="disabled",
               PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def train(run_dir: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           "--stage", STAGE, "tracking.wandb_mode=disabled", "tracking.console=false", *overrides]
    if run_dir.exists():  # a run that did not finish (killed): start it afresh, not resumed or appended to
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    rc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}); see {log.name}")


def sft_checkpoint(work: Path, eval_size: int, sft_args: list[str]) -> Path:
    """The demo's cold start (configs/demo_cpu.yaml's sft section), once; its data (written by the
    demo's generator) holds ``eval_size`` held-out problems."""
    sft = work / "sft"
    final = sft / "sft" / "final"
    if not (final / "trainer_state.json").exists():
        if not BUDGET.allows("sft"):
            raise SystemExit(0)
        print(f"SFT cold start into {sft} ...", flush=True)
        t0 = time.perf_counter()
        sft.parent.mkdir(parents=True, exist_ok=True)
        # one GRPO step (a stage runs at least one; it is not used); the run's "start" evaluation
        # is the SFT weights' held-out accuracy
        # the in-process engine (the demo's): the cold start is not timed, and it is the same
        # checkpoint whichever engine sampled its validation answers
        train(sft, ["stages.0.max_steps=1", f"synthetic.eval_size={eval_size}", *sft_args])
        BUDGET.record("sft", time.perf_counter() - t0)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return sft


def final_weights_check(run_dir: Path, eval_path: Path) -> dict:
    """Whether the run's final evaluation scored the final weights: the stage's final weights as
    the trainer wrote them (``final/hf``) decoded greedily by transformers (a plain argmax loop
    with its KV cache, prompts of one length per batch: no padding), compared problem by problem with the engine's
    answers of that evaluation (``RUN_DIR/eval/<stage>.jsonl``), whose weight-version labels (the
    engine's own) must be the trainer's final version."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.dataset import load_prompts
    from megatron_rl.rewards import RewardConfig, RewardManager
    from megatron_rl.trainer.phases import reward_item

    hf = run_dir / STAGE / "final" / "hf"
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    records, _ = load_prompts(eval_path, tok, max_prompt_len=0)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_len.setdefault(len(r.prompt_ids), []).append(i)
    texts = [""] * len(records)
    eos = tok.eos_token_id
    with torch.no_grad():
        for idx in by_len.values():
            out = model(torch.tensor([records[i].prompt_ids for i in idx]), use_cache=True)
            steps = []
            for _ in range(STAGE_MAX_TOKENS):
                steps.append(out.logits[:, -1].argmax(-1, keepdim=True))
                out = model(steps[-1], past_key_values=out.past_key_values, use_cache=True)
            for i, row in zip(idx, torch.cat(steps, 1).tolist()):
                texts[i] = tok.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True)
    mgr = RewardManager(RewardConfig())
    try:
        scores, _ = mgr.score([reward_item(r, t) for r, t in zip(records, texts)])
    finally:
        mgr.close()
    engine = {}
    answers = run_dir / "eval" / f"{STAGE}.jsonl"
    if answers.exists():
        engine = {a["row"]: a for a in map(json.loads, answers.read_text().splitlines())}
    same = [engine[r.row]["response"] == t for r, t in zip(records, texts) if r.row in engine]
    final_version = json.loads((run_dir / STAGE / "final" / "trainer_state.json").read_text())["weight_version"]
    return {"accuracy_hf": sum(x >= 1.0 for x in scores) / len(scores), "n": len(records),
            "answers_compared": len(same), "answers_equal": sum(same),
            "engine_versions": sorted({a["weight_version"] for a in engine.values()}),
            "trainer_version": final_version}


def grpo_run(work: Path, sft: Path, mode: str, seed: int, steps: int, algo: list[str], make: bool = True,
             eval_every: int = 10) -> dict | None:
    """One GRPO run's figures; made first if it is not in ``work`` yet and ``make`` (else None).
    The runs of one objective live in ``work/<objective tag>/`` (the first objective's, TIS, in
    ``work`` itself, where the earlier sessions' runs are)."""
    tag = objective_tag(algo)
    run_dir = (work if tag == "tis_token" else work / tag) / f"{mode}_seed{seed}"
    if not (run_dir / STAGE / "final" / "trainer_state.json").exists():
        if not make or not BUDGET.allows(mode):
            return None
        overrides = [
            "sft.enabled=false", f"trainer.init_from={sft / 'sft' / 'final'}", f"trainer.seed={seed}",
            f"model.path={sft / 'base_model'}", "synthetic.enabled=false",
            f"data.train_path={sft / 'data' / 'train.jsonl'}", f"eval.path={sft / 'data' / 'eval.jsonl'}",
            f"stages.0.max_steps={steps}", f"eval.every={eval_every}", "trainer.save_every=0",
            *MODES[mode], *PLACEMENT, *algo,
        ]
        t0 = time.perf_counter()
        train(run_dir, overrides)
        (run_dir / "bench_load.txt").write_text(loadavg())
        BUDGET.record(mode, time.perf_counter() - t0)
        print(f"  {mode} seed {seed}: process {time.perf_counter() - t0:.0f} s (load {loadavg()})", flush=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["stage"] == STAGE]
    ev = json.loads((run_dir / "run_state.json").read_text())["eval"]
    # The run's own evaluations: every eval_every steps, and the final weights' (run_state).
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] + [ev[STAGE]["eval/accuracy"]]
    check_file = run_dir / "bench_final_weights_check.json"
    if not check_file.exists():
        check_file.write_text(json.dumps(final_weights_check(run_dir, sft / "data" / "eval.jsonl")))
    check = json.loads(check_file.read_text())
    split = {k: statistics.mean(r.get(f"timing/{k}", 0.0) for r in rows)
             for k in ("gen", "reward", "logprob", "update", "sync", "other", "step")}
    return {"mode": mode, "seed": seed, "steps": len(rows), "wall_s": sum(r["timing/step"] for r in rows),
            "accuracy": ev[STAGE]["eval/accuracy"], "check": check,
            "accuracy_hf": check["accuracy_hf"],
            # the mean of the last three evaluations (steps 80, 90, 100 by default): less of the
            # checkpoint-to-checkpoint swing of greedy accuracy
            "accuracy_last3": statistics.mean(evals[-3:]), "eval_n": ev[STAGE]["eval/n"],
            # the training reward (sampled, T=1) over the last 20 steps: a second, less noisy view
            "reward_last": statistics.mean(r["reward/mean"] for r in rows[-20:]),
            "entropy_last": statistics.mean(r.get("actor/entropy", 0.0) for r in rows[-20:]),
            "split": split, "trainer_wait_s": statistics.mean(r.get("async/trainer_wait_s", 0.0) for r in rows),
            "engine_idle_s": statistics.mean(r.get("async/engine_idle_s", 0.0) for r in rows),
            "load": (run_dir / "bench_load.txt").read_text().split()[0]}


def versus_inproc(runs: list[dict], seeds: set[int]) -> dict:
    """One-step-off against the simplest loop (``inproc``) over the seeds with both runs made: the
    wall-time ratio of the medians (target <= 0.8) and the accuracies (printed, and as JSON keys)."""
    if not seeds:
        return {}
    by = {(r["mode"], r["seed"]): r for r in runs if r["seed"] in seeds}
    med = {m: {k: statistics.median(by[m, s][k] for s in seeds) for k in ("wall_s", "accuracy", "accuracy_last3")}
           for m in ("inproc", "async")}
    paired = [round(100 * (by["async", s]["accuracy"] - by["inproc", s]["accuracy"]), 1) for s in sorted(seeds)]
    out = {"wall_ratio_vs_inproc": med["async"]["wall_s"] / med["inproc"]["wall_s"],
           "wall_inproc_s": med["inproc"]["wall_s"], "accuracy_inproc": med["inproc"]["accuracy"],
           "accuracy_last3_inproc": med["inproc"]["accuracy_last3"], "paired_gap_points_vs_inproc": paired,
           "seeds_vs_inproc": sorted(seeds)}
    print(f"\nasync / in-process synchronous loop wall time: {out['wall_ratio_vs_inproc']:.3f} (target <= 0.8); "
          f"held-out accuracy in-process {med['inproc']['accuracy']:.3f}, async {med['async']['accuracy']:.3f} "
          f"(per seed async - in-process {paired} points)")
    return out


def reference(by: dict, seed: int) -> dict:
    """The synchronous run a seed's one-step-off run is paired with: the server's synchronous loop
    (``sync``) where it was made, else the in-process loop (``inproc``). Both are max_staleness=0
    with the same seeds, data and objective, so they train on the same samples (seed 1 of the
    session-9 runs: the same final accuracy, 0.3675, and last-20 reward in both); pairing with the
    in-process loop spares the slower server run when a seed already has it for the wall-time
    comparison. The summary prints both where a seed has both."""
    return by.get(("sync", seed)) or by["inproc", seed]


def main() -> None:
    from megatron_rl.common.cli_args import ArgumentParser
    from megatron_rl.trainer.schema import load_run_config

    p = ArgumentParser(prog="python benchmarks/async_speedup.py", command="async_speedup")
    p.add_argument("--steps", type=int, default=100)
    # The seeds of the pairs, in order (default 1 .. --max-pairs): pairs are run until the 95 %
    # interval of the mean paired gap is narrower than --ci-points with at least --min-pairs pairs.
    p.add_argument("--seeds", type=int, nargs="*", default=None)
    p.add_argument("--min-pairs", type=int, default=6)
    p.add_argument("--max-pairs", type=int, default=12)
    p.add_argument("--ci-points", type=float, default=2.0)
    # Overrides of the SFT cold start (e.g. a smaller sft.stop_accuracy for a smoke run).
    p.add_argument("--sft-args", nargs="*", default=[])
    # Which runs to make (finished runs are reused): one locked command per (seed, mode) keeps each
    # piece short on a shared box; the summary covers every finished run of --seeds.
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_async")
    # Held-out problems (written once with the SFT run's data): 2000 puts the binomial standard
    # error of one accuracy at about 1.1 points (0.5 * 0.5 / 2000), half of 500's.
    p.add_argument("--eval-size", type=int, default=2000)
    # Held-out evaluations during a run (not counted in its wall time): the mean of the last three
    # is reported beside the final one.
    p.add_argument("--eval-every", type=int, default=10)
    # Seconds this invocation may take (runs that would not fit are left for the next one).
    p.add_argument("--budget-s", type=float, default=None)
    # Both modes train with the same objective; TIS weighs each token by pi_old / pi_engine, which
    # one-step-off needs (stale samples) and costs the synchronous run one old-log-prob pass.
    p.add_argument("--algo", nargs="*", default=["algo.mismatch.mode=tis_token"])
    args = p.parse_args()
    # the runs' config with --algo's overrides, checked now: a bad key is one line here, not a failed
    # run's log after the SFT cold start
    run_cfg = load_run_config(CONFIG, list(args.algo))
    run_cfg.stage(STAGE)
    a = run_cfg.algo
    objective = {"policy_loss": a.policy_loss, "mismatch": a.mismatch.mode, "mini_batches": a.mini_batches,
                 "n_sgd": a.n_sgd, "overrides": list(args.algo), "tag": objective_tag(list(args.algo))}
    if a.policy_loss == "decoupled_ppo":
        objective["decoupled"] = a.decoupled.to_dict()
    seeds = args.seeds if args.seeds is not None else list(range(1, args.max_pairs + 1))
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (engine and trainer each on one)")
    BUDGET.setup(args.work, args.budget_s)
    print(f"load average before: {loadavg()}", flush=True)
    sft = sft_checkpoint(args.work, args.eval_size, args.sft_args)
    sft_acc = json.loads((sft / "run_state.json").read_text())["eval"]["start"]["eval/accuracy"]
    print(f"held-out accuracy after the SFT cold start: {sft_acc:.3f}; GRPO overrides: {args.algo}")
    print(f"objective: {objective}", flush=True)
    runs, gaps = [], []
    for seed in seeds:
        pair = {}
        for mode in MODES:  # the pair (sync, async) makes the gap; inproc beside it
            r = grpo_run(args.work, sft, mode, seed, args.steps, args.algo, make=mode in args.modes,
                         eval_every=args.eval_every)
            if r is not None:
                runs.append(r)
                pair[mode] = r
        ref = pair.get("sync") or pair.get("inproc")  # the synchronous run of the seed (see reference())
        if "async" in pair and ref is not None:
            gaps.append(pair["async"]["accuracy"] - ref["accuracy"])
            mean, half = paired_interval(gaps)
            print(f"  after {len(gaps)} pairs: mean paired gap {100 * mean:+.2f} points, 95 % interval "
                  f"+-{100 * half:.2f}", flush=True)
            if len(gaps) >= args.min_pairs and 100 * half < args.ci_points:
                break
    # The summary pairs one-step-off with the synchronous loop seed by seed: only seeds with an async
    # run and a synchronous one (on the server, or the in-process loop: see reference()) count.
    modes_of = {}
    for r in runs:
        modes_of.setdefault(r["seed"], set()).add(r["mode"])
    complete = {sd for sd, m in modes_of.items() if "async" in m and m & {"sync", "inproc"}}
    inproc_seeds = {sd for sd, m in modes_of.items() if {"async", "inproc"} <= m}
    if not complete:
        print(json.dumps({"accuracy_sft": sft_acc, "runs": [(r["mode"], r["seed"], r["accuracy"]) for r in runs],
                          "load": loadavg()}))
        return
    runs = [r for r in runs if r["seed"] in complete]
    print(f"load average after: {loadavg()}")
    print("\nThe final evaluation vs the final weights (transformers' greedy answers of final/hf):")
    for r in runs:
        c = r["check"]
        print(f"  {r['mode']} seed {r['seed']}: {c['answers_equal']} of {c['answers_compared']} answers equal; "
              f"engine weight versions {c['engine_versions']}, trainer's final version {c['trainer_version']}; "
              f"accuracy engine {r['accuracy']:.4f}, transformers {c['accuracy_hf']:.4f}")
    print("\n| run | steps | GRPO wall s | s/step | gen | reward | logprob | update | sync | other | "
          "trainer wait | held-out acc | same, transformers | mean of last 3 evals | reward, last 20 | "
          "entropy, last 20 | load (1 min, at end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        s = r["split"]
        print(f"| {r['mode']} seed {r['seed']} | {r['steps']} | {r['wall_s']:.0f} | {s['step']:.2f} | {s['gen']:.2f} | "
              f"{s['reward']:.2f} | {s['logprob']:.2f} | {s['update']:.2f} | {s['sync']:.2f} | {s['other']:.2f} | "
              f"{r['trainer_wait_s']:.2f} | {r['accuracy']:.3f} | {r['accuracy_hf']:.3f} | {r['accuracy_last3']:.3f} | "
              f"{r['reward_last']:.3f} | {r['entropy_last']:.3f} | {r['load']} |")
    every = runs
    by = {(r["mode"], r["seed"]): r for r in runs}
    both = [sd for sd in seeds if sd in complete]
    ref = {sd: reference(by, sd) for sd in both}
    servers = [sd for sd in both if ("sync", sd) in by]  # seeds with a synchronous run on the server
    keys = ("accuracy", "accuracy_last3", "reward_last")
    med = {"sync": {k: statistics.median(ref[sd][k] for sd in both) for k in keys},
           "async": {k: statistics.median(by["async", sd][k] for sd in both) for k in keys}}
    paired = [by["async", sd]["accuracy"] - ref[sd]["accuracy"] for sd in both]
    paired_last3 = [by["async", sd]["accuracy_last3"] - ref[sd]["accuracy_last3"] for sd in both]
    gap_mean, gap_half = paired_interval(paired)
    last3_mean, last3_half = paired_interval(paired_last3)
    sync_acc = [ref[sd]["accuracy"] for sd in both]
    # The noise floor: how far two synchronous runs (same SFT weights, same held-out set, another
    # seed) land apart; an async-sync gap inside it cannot be told from seed noise.
    sync_spread = max(sync_acc) - min(sync_acc)
    sync_sd = statistics.stdev(sync_acc) if len(sync_acc) > 1 else float("nan")
    # The largest disagreement between the run's evaluation (the engine) and transformers' greedy
    # decoding of the final weights the trainer wrote: ~0 when the evaluation scored those weights.
    hf_gap = max(abs(r["accuracy"] - r["accuracy_hf"]) for r in runs)
    # The two synchronous loops train on the same samples: where a seed has both, how far apart.
    twins = [abs(by["sync", sd]["accuracy"] - by["inproc", sd]["accuracy"]) for sd in both
             if ("sync", sd) in by and ("inproc", sd) in by]
    # Wall times against the server's synchronous loop, over the seeds that have one; the floor of
    # one-step-off from the synchronous split: the slower side, plus the sync itself.
    sync_runs = [by["sync", sd] for sd in servers] or [ref[sd] for sd in both]
    floors = []
    for r in sync_runs:
        s = r["split"]
        floors.append((max(s["gen"] + s["reward"], s["logprob"] + s["update"]) + s["sync"] + s["other"]) / s["step"])
    # Without TIS a synchronous run would skip its old-log-prob pass (the async run never can: its
    # samples are stale): the ratio against that loop, estimated from the sync runs' own split.
    bare = statistics.median(r["wall_s"] - r["split"]["logprob"] * r["steps"] for r in sync_runs)
    wall_sync = statistics.median(r["wall_s"] for r in sync_runs)
    wall_async = statistics.median(by["async", sd]["wall_s"] for sd in (servers or both))
    n = int(runs[0]["eval_n"])
    out = {"wall_ratio": wall_async / wall_sync if servers else None,
           "wall_ratio_vs_sync_without_logprob_est": wall_async / bare if servers else None,
           "sync_reference": {sd: ref[sd]["mode"] for sd in both},
           "sync_vs_inproc_max_gap_points": 100 * max(twins) if twins else None,
           "accuracy_sync": med["sync"]["accuracy"], "accuracy_async": med["async"]["accuracy"],
           "accuracy_gap_points": 100 * (med["async"]["accuracy"] - med["sync"]["accuracy"]),
           "paired_gap_points_median": 100 * statistics.median(paired) if paired else None,
           "paired_gap_points": [round(100 * d, 1) for d in paired],
           "paired_gap_mean_points": 100 * gap_mean, "paired_gap_ci95_points": 100 * gap_half,
           "paired_gap_last3_mean_points": 100 * last3_mean, "paired_gap_last3_ci95_points": 100 * last3_half,
           "pairs": len(paired), "settled": len(paired) >= args.min_pairs and 100 * gap_half < args.ci_points,
           "objective": objective,
           "sync_spread_points": 100 * sync_spread, "sync_sd_points": 100 * sync_sd,
           "eval_se_points": 100 * (0.25 / n) ** 0.5, "eval_n": n,
           "accuracy_last3_sync": med["sync"]["accuracy_last3"], "accuracy_last3_async": med["async"]["accuracy_last3"],
           "engine_vs_transformers_max_gap": hf_gap,
           "final_answers_equal_min_frac": min(r["check"]["answers_equal"] / max(r["check"]["answers_compared"], 1)
                                               for r in runs),
           "final_eval_at_final_version": all(r["check"]["engine_versions"] == [r["check"]["trainer_version"]]
                                              for r in runs),
           "accuracy_sft": sft_acc, "reward_last20_sync": med["sync"]["reward_last"],
           "reward_last20_async": med["async"]["reward_last"],
           "floor_ratio": statistics.median(floors), "wall_sync_s": wall_sync if servers else None,
           "wall_async_s": wall_async, "steps": args.steps,
           "seeds": sorted({r["seed"] for r in runs}), "algo": args.algo, "load": loadavg(),
           **versus_inproc(every, inproc_seeds)}
    print(f"paired gap async - sync over {len(paired)} pairs: final evaluation {out['paired_gap_mean_points']:+.2f} "
          f"+- {out['paired_gap_ci95_points']:.2f} points (95 %), mean of the last three evaluations "
          f"{out['paired_gap_last3_mean_points']:+.2f} +- {out['paired_gap_last3_ci95_points']:.2f}; "
          f"{'settled' if out['settled'] else 'NOT settled'} (needs >= {args.min_pairs} pairs and an "
          f"interval narrower than +-{args.ci_points} points); objective {objective['tag']}: {args.algo}")
    if servers:
        print(f"\nasync / sync wall time: {out['wall_ratio']:.3f} (one-step-off floor from the sync split: "
              f"{out['floor_ratio']:.3f}; against a sync loop without the old-log-prob pass, estimated: "
              f"{out['wall_ratio_vs_sync_without_logprob_est']:.3f})")
    if twins:
        print(f"the two synchronous loops (server, in-process) on the same seeds: final accuracies at most "
              f"{100 * max(twins):.2f} points apart over {len(twins)} seeds")
    print(f"held-out accuracy ({n} problems, binomial SE {out['eval_se_points']:.1f} points), medians: sync "
          f"{out['accuracy_sync']:.3f}, async {out['accuracy_async']:.3f} ({out['accuracy_gap_points']:+.1f} points); "
          f"per seed async - sync {out['paired_gap_points']} points; sync runs across seeds span "
          f"{out['sync_spread_points']:.1f} points (sd {out['sync_sd_points']:.1f}); engine vs transformers on the "
          f"final weights: at most {hf_gap:.4f}")
    print(json.dumps(out))


if __name__ == "__main__":
    from megatron_rl.common.cli_args import run_main

    sys.exit(run_main(main))
