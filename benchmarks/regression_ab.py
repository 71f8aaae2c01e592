"""Is a GRPO step slower than at an earlier commit? Same-run A/B, one core each, alternated.

A = ``--base`` (default f916a89, the end of the first wave of work), B = ``--head`` (default this
checkout's HEAD commit; ``.``: the working tree as it is), each checked out into a temporary
``git worktree`` (under ``--trees``), so edits made while a run waits for its turn do not leak into
it. Both run from the same shared virtualenv, the
same SFT'd starting weights (the demo's cold start, made once with B's code into ``--work`` and
given to both as ``model.path``: a Hugging Face directory every commit reads) and the same data.
Two tasks on the demo's config (``configs/demo_cpu.yaml``, stage ``stage1_12``: 64 prompts x 8
samples, responses up to 12 tokens, the in-process vLLM engine, weights synced in process):

- ``peer``: the peer-style task (what verl / NeMo-RL's quick-start GRPO runs: no entropy term),
  ``--peer-steps`` (40) steps;
- ``demo``: the demo's own settings (adaptive entropy on), ``--demo-steps`` (30) steps.

Each round starts A and B at the same time, each pinned to one core (``sched_setaffinity`` and
vLLM's OpenMP threads bound to it), and swaps the cores every round, so the two commits share the
box's load alike. Evaluations are off and W&B is disabled in both (neither is inside a step);
everything else (B's rollout dumps included) is each commit's default. Per run, the means of
``timing/*`` over the steps after the first two (warm-up); the table gives B / A per phase as the
median over rounds. The last line is one JSON object: ``{"step_ratio": {task: B/A}, ...}``.

    python benchmarks/regression_ab.py [--rounds 2] [--tasks peer demo] [--work runs/bench_ab]
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
STAGE = "stage1_12"
PHASES = ("gen", "reward", "logprob", "update", "sync", "dump", "other", "step")
COMMON = ["tracking.wandb_mode=disabled", "tracking.console=false", "eval.every=0", "trainer.save_every=0",
          "sft.enabled=false", "synthetic.enabled=false"]
TASKS = {
    "peer": ["algo.entropy.mode='off'"],  # quoted: YAML reads a bare off as false
    "demo": [],
}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def checkout(commit: str, where: Path) -> Path:
    """``commit`` as a detached worktree at ``where`` (made once; reused while it is at that commit)."""
    if (where / ".git").exists():
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        want = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], capture_output=True, text=True,
                              check=True).stdout
        if head.strip() == want.strip():
            return where
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], check=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), commit], check=True,
                   capture_output=True)
    return where


def _env(tree: Path, core: int | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", WANDB_MODE="disabled",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(tree))
    if core is not None:  # vLLM's CPU worker binds its OpenMP threads itself: to this core only
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def start(tree: Path, run_dir: Path, overrides: list[str], core: int | None, profile: bool = False
          ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(tree / "configs" / "demo_cpu.yaml"),
           "--run-dir", str(run_dir), "--stage", STAGE, *overrides]
    if profile:  # py-spy's collapsed stacks of the whole run (its sampler shares the run's core)
        spy = Path(sys.executable).with_name("py-spy")
        cmd = [str(spy), "record", "--format", "raw", "--rate", "200", "--nonblocking", "--threads",
               "-o", str(run_dir.parent / f"{run_dir.name}.stacks"), "--", *cmd]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(cmd, cwd=tree, env=_env(tree, core), stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None)


def wait(procs: dict[str, subprocess.Popen], work: Path) -> None:
    """Wait for every run; one that fails stops the others."""
    for name, p in procs.items():
        if p.wait() != 0:
            for other in procs.values():
                if other.poll() is None:
                    other.kill()
                    other.wait()
            raise SystemExit(f"{name} failed (rc {p.returncode}); see {work}/{name}.log")


def sft_weights(work: Path) -> tuple[Path, Path]:
    """The demo's SFT cold start (B's code, once): its weights after one GRPO step as a Hugging Face
    directory, and its data directory."""
    run = work / "sft"
    hf = run / STAGE / "final" / "hf"
    if not (hf / "config.json").exists():
        print(f"SFT cold start into {run} ...", flush=True)
        t0 = time.perf_counter()
        p = start(REPO, run, ["tracking.wandb_mode=disabled", "tracking.console=false", "stages.0.max_steps=1"], None)
        wait({"sft": p}, work)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return hf, run / "data"


def split(run_dir: Path, skip: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("stage") == STAGE and "timing/step" in r][skip:]
    out = {k: statistics.mean(r.get(f"timing/{k}", 0.0) for r in rows) for k in PHASES}
    out["steps"] = len(rows)
    out["updates"] = sum("actor/grad_norm" in r or "grad_norm" in r or "timing/update" in r for r in rows)
    out["response_len"] = statistics.mean(r.get("rollout/response_length_mean", 0.0) for r in rows)
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python benchmarks/regression_ab.py", description=__doc__.split("\n")[0])
    p.add_argument("--base", default="f916a89")
    p.add_argument("--head", default="HEAD", help="B: a commit, or . for this working tree as it is")
    p.add_argument("--trees", type=Path, default=Path("/tmp") / f"megatron-rl-ab-{os.getuid()}")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_ab")
    p.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    p.add_argument("--rounds", type=int, default=2, help="rounds per task (the cores swap every round)")
    p.add_argument("--peer-steps", type=int, default=40)
    p.add_argument("--demo-steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the means")
    p.add_argument("--sft-only", action="store_true", help="only make the SFT weights")
    p.add_argument("--profile", action="store_true",
                   help="then one more round per task under py-spy (collapsed stacks in --work, not timed)")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores (A and B each on one)")
    print(f"load average before: {loadavg()}", flush=True)
    hf, data = sft_weights(args.work)
    if args.sft_only:
        return
    def tree(commit: str) -> Path:
        if commit == ".":
            return REPO
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", commit], capture_output=True,
                             text=True, check=True).stdout.strip()
        return checkout(sha, args.trees / sha)

    trees = {"A": tree(args.base), "B": tree(args.head)}
    print(f"A = {trees['A']}, B = {trees['B']}", flush=True)
    shared = [f"model.path={hf}", f"data.train_path={data / 'train.jsonl'}", f"eval.path={data / 'eval.jsonl'}"]
    steps = {"peer": args.peer_steps, "demo": args.demo_steps}
    results: dict = {}
    for task in args.tasks:
        overrides = [*COMMON, *shared, *TASKS[task], f"stages.0.max_steps={steps[task]}"]
        for r in range(args.rounds):
            pin = {"A": cores[r % 2], "B": cores[(r + 1) % 2]}
            t0 = time.perf_counter()
            procs = {f"{task}_{ab}_r{r}": start(trees[ab], args.work / f"{task}_{ab}_r{r}", overrides, pin[ab])
                     for ab in ("A", "B")}
            wait(procs, args.work)
            for ab in ("A", "B"):
                results.setdefault(task, {}).setdefault(ab, []).append(split(args.work / f"{task}_{ab}_r{r}", args.skip))
            print(f"  {task} round {r}: A on core {pin['A']}, B on core {pin['B']}, {time.perf_counter() - t0:.0f} s "
                  f"(load {loadavg()})", flush=True)
    if args.profile:
        for task in args.tasks:
            overrides = [*COMMON, *shared, *TASKS[task], f"stages.0.max_steps={steps[task]}"]
            procs = {f"{task}_{ab}_profile": start(trees[ab], args.work / f"{task}_{ab}_profile", overrides,
                                                   cores[i], profile=True) for i, ab in enumerate(("A", "B"))}
            wait(procs, args.work)
            print(f"  {task}: profiles in {args.work}/{task}_[AB]_profile.stacks", flush=True)
    print(f"load average after: {loadavg()}")
    summary: dict = {"base": args.base, "head": args.head, "rounds": args.rounds, "load": loadavg(), "step_ratio": {}, "phases": {}}
    for task, by in results.items():
        print(f"\n{task} ({by['A'][0]['steps']} steps timed; means per step, medians over {args.rounds} rounds)")
        print("| phase | A s | B s | B / A |")
        print("|---|---|---|---|")
        med = {ab: {k: statistics.median(x[k] for x in by[ab]) for k in (*PHASES, "response_len")} for ab in by}
        for k in PHASES:
            ratio = med["B"][k] / med["A"][k] if med["A"][k] > 0 else float("nan")
            print(f"| {k} | {med['A'][k]:.3f} | {med['B'][k]:.3f} | {ratio:.2f} |")
        print(f"| response length | {med['A']['response_len']:.2f} | {med['B']['response_len']:.2f} | |")
        per_round = [b["step"] / a["step"] for a, b in zip(by["A"], by["B"])]
        summary["step_ratio"][task] = round(statistics.median(per_round), 4)
        summary["phases"][task] = {ab: {k: round(v, 4) for k, v in med[ab].items()} for ab in med}
        summary.setdefault("step_ratio_per_round", {})[task] = [round(x, 4) for x in per_round]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
