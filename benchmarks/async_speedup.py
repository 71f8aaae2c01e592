"""Asynchronous GRPO vs synchronous on the CPU demo: wall time and held-out accuracy, in one run.

From the demo's SFT cold start (made once, reused from ``--work``), the demo's first GRPO stage
(64 prompts x 8 samples, max response 12 tokens) runs ``--steps`` steps

- ``sync``:  ``rollout.async.max_staleness=0`` (today's loop: generate, train, sync in turn),
- ``async``: ``rollout.async.max_staleness=1`` (one-step-off: the next wave generates while the
  trainer trains),

for each of ``--seeds`` (data order and sampling seeds; same SFT checkpoint, same data and held-out
set), both with the same objective (``--algo``, default TIS: stale samples need it, and it costs the
synchronous run an old-log-prob pass). The trainer process is pinned to core 0 and the engine
(a vLLM server the trainer starts: ``vllm_server``, colocated, gloo sync) to core 1, one thread each. Prints, per run, the GRPO wall time (the steps' summed ``timing/step``),
the greedy held-out accuracy after the stage (500 problems; also for the SFT weights themselves) and
the step's time split; then the ratios: async vs sync (ours vs naive), the physical floor of
one-step-off, max(generation + reward, old log-probs + update) + sync per step, from the sync runs'
own split, and (estimated from that split) async vs a synchronous loop that skips the old-log-prob
pass (no TIS). The last line is one JSON object: ``{"wall_ratio", "accuracy_sync",
"accuracy_async", ...}`` (medians over seeds).

    python benchmarks/async_speedup.py [--steps 100] [--seeds 1 2] [--work runs/bench_async]

The SFT checkpoint and every finished run are kept in ``--work`` and reused, so the script can be
run in pieces (``--seeds 1``, then ``--seeds 1 2``). The box is shared: the load average is printed
before and after and per run; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
STAGE = "stage1_12"
ENGINE_CORE, TRAINER_CORE = 1, 0
# The engine in its own process: one vLLM server, started by the trainer, weights over gloo.
SERVER = ["rollout.engine=vllm_server", "rollout.placement=colocated", "sync.transport=gloo",
          "sync.bucket_bytes=16777216"]


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", WANDB_MODE="disabled",
               PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                out.append(int(d.name))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _pin_engine(trainer: subprocess.Popen, stop: threading.Event) -> None:
    """The engine is a vLLM server the trainer started (API server, EngineCore, worker): pin every
    thread of those processes to ENGINE_CORE (repeatedly: vLLM starts threads while it boots)."""
    while not stop.wait(0.5):
        for child in _children(trainer.pid):
            try:
                if b"vllm.entrypoints" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    continue
                for pid in [child, *_descendants(child)]:
                    for tid in Path(f"/proc/{pid}/task").iterdir():
                        os.sched_setaffinity(int(tid.name), {ENGINE_CORE})
            except OSError:
                pass


def train(run_dir: Path, overrides: list[str], pin: bool) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           "--stage", STAGE, "tracking.wandb_mode=disabled", "tracking.console=false", *overrides]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, {TRAINER_CORE})) if pin else None)
    stop = threading.Event()
    pinner = threading.Thread(target=_pin_engine, args=(proc, stop), daemon=True)
    if pin:
        pinner.start()
    rc = proc.wait()
    stop.set()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}); see {log.name}")


def sft_checkpoint(work: Path) -> Path:
    """The demo's cold start (configs/demo_cpu.yaml's sft section), once."""
    sft = work / "sft"
    final = sft / "sft" / "final"
    if not (final / "trainer_state.json").exists():
        print(f"SFT cold start into {sft} ...", flush=True)
        t0 = time.perf_counter()
        sft.parent.mkdir(parents=True, exist_ok=True)
        # one GRPO step (a stage runs at least one; it is not used); the run's "start" evaluation
        # is the SFT weights' held-out accuracy
        train(sft, ["stages.0.max_steps=1", *SERVER], pin=False)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return sft


def grpo_run(work: Path, sft: Path, mode: str, seed: int, steps: int, algo: list[str]) -> dict:
    run_dir = work / f"{mode}_seed{seed}"
    if not (run_dir / STAGE / "final" / "trainer_state.json").exists():
        overrides = [
            "sft.enabled=false", f"trainer.init_from={sft / 'sft' / 'final'}", f"trainer.seed={seed}",
            f"model.path={sft / 'base_model'}", "synthetic.enabled=false",
            f"data.train_path={sft / 'data' / 'train.jsonl'}", f"eval.path={sft / 'data' / 'eval.jsonl'}",
            f"stages.0.max_steps={steps}", "eval.every=0", "trainer.save_every=0", *SERVER,
            f"rollout.async.max_staleness={1 if mode == 'async' else 0}", *algo,
        ]
        t0 = time.perf_counter()
        train(run_dir, overrides, pin=True)
        (run_dir / "bench_load.txt").write_text(loadavg())
        print(f"  {mode} seed {seed}: process {time.perf_counter() - t0:.0f} s (load {loadavg()})", flush=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["stage"] == STAGE]
    ev = json.loads((run_dir / "run_state.json").read_text())["eval"]
    split = {k: statistics.mean(r.get(f"timing/{k}", 0.0) for r in rows)
             for k in ("gen", "reward", "logprob", "update", "sync", "other", "step")}
    return {"mode": mode, "seed": seed, "steps": len(rows), "wall_s": sum(r["timing/step"] for r in rows),
            "accuracy": ev[STAGE]["eval/accuracy"],
            # the training reward (sampled, T=1) over the last 20 steps: a second, less noisy view
            "reward_last": statistics.mean(r["reward/mean"] for r in rows[-20:]),
            "entropy_last": statistics.mean(r.get("actor/entropy", 0.0) for r in rows[-20:]),
            "split": split, "trainer_wait_s": statistics.mean(r.get("async/trainer_wait_s", 0.0) for r in rows),
            "engine_idle_s": statistics.mean(r.get("async/engine_idle_s", 0.0) for r in rows),
            "load": (run_dir / "bench_load.txt").read_text().split()[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_async")
    # Both modes train with the same objective; TIS weighs each token by pi_old / pi_engine, which
    # one-step-off needs (stale samples) and costs the synchronous run one old-log-prob pass.
    p.add_argument("--algo", nargs="*", default=["algo.mismatch.mode=tis_token"])
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (engine and trainer each on one)")
    print(f"load average before: {loadavg()}", flush=True)
    sft = sft_checkpoint(args.work)
    sft_acc = json.loads((sft / "run_state.json").read_text())["eval"]["start"]["eval/accuracy"]
    print(f"held-out accuracy after the SFT cold start: {sft_acc:.3f}; GRPO overrides: {args.algo}")
    runs = []
    for seed in args.seeds:
        for mode in ("sync", "async"):
            runs.append(grpo_run(args.work, sft, mode, seed, args.steps, args.algo))
    print(f"load average after: {loadavg()}")
    print("\n| run | steps | GRPO wall s | s/step | gen | reward | logprob | update | sync | other | "
          "trainer wait | held-out acc | reward, last 20 | entropy, last 20 | load (1 min, at end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        s = r["split"]
        print(f"| {r['mode']} seed {r['seed']} | {r['steps']} | {r['wall_s']:.0f} | {s['step']:.2f} | {s['gen']:.2f} | "
              f"{s['reward']:.2f} | {s['logprob']:.2f} | {s['update']:.2f} | {s['sync']:.2f} | {s['other']:.2f} | "
              f"{r['trainer_wait_s']:.2f} | {r['accuracy']:.3f} | {r['reward_last']:.3f} | {r['entropy_last']:.3f} | "
              f"{r['load']} |")
    med = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m) for k in ("wall_s", "accuracy", "reward_last")}
           for m in ("sync", "async")}
    # The floor of one-step-off from the synchronous split: the slower side, plus the sync itself.
    floors = []
    for r in (r for r in runs if r["mode"] == "sync"):
        s = r["split"]
        floors.append((max(s["gen"] + s["reward"], s["logprob"] + s["update"]) + s["sync"] + s["other"]) / s["step"])
    # Without TIS a synchronous run would skip its old-log-prob pass (the async run never can: its
    # samples are stale): the ratio against that loop, estimated from the sync runs' own split.
    bare = statistics.median(r["wall_s"] - r["split"]["logprob"] * r["steps"] for r in runs if r["mode"] == "sync")
    out = {"wall_ratio": med["async"]["wall_s"] / med["sync"]["wall_s"],
           "wall_ratio_vs_sync_without_logprob_est": med["async"]["wall_s"] / bare,
           "accuracy_sync": med["sync"]["accuracy"], "accuracy_async": med["async"]["accuracy"],
           "accuracy_sft": sft_acc, "reward_last20_sync": med["sync"]["reward_last"],
           "reward_last20_async": med["async"]["reward_last"],
           "floor_ratio": statistics.median(floors), "wall_sync_s": med["sync"]["wall_s"],
           "wall_async_s": med["async"]["wall_s"], "steps": args.steps, "seeds": args.seeds, "load": loadavg()}
    print(f"\nasync / sync wall time: {out['wall_ratio']:.3f} (one-step-off floor from the sync split: "
          f"{out['floor_ratio']:.3f}; against a sync loop without the old-log-prob pass, estimated: "
          f"{out['wall_ratio_vs_sync_without_logprob_est']:.3f}); held-out accuracy sync {out['accuracy_sync']:.3f}, async "
          f"{out['accuracy_async']:.3f} ({100 * (out['accuracy_async'] - out['accuracy_sync']):+.1f} points)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
