"""On-policy distillation on the CPU demo: does a teacher that solves the task raise the student's
held-out accuracy? One run, paired seeds.

The student is the demo's SFT cold start (``configs/demo_cpu.yaml``: stops at 0.25 validation
accuracy); the teacher is the same SFT run on to ``--teacher-stop`` (0.95) validation accuracy, then
one GRPO step (its ``stage1_12/final/hf`` export is the teacher checkpoint). From the student, the
demo's first GRPO stage (64 prompts x 8 samples, max response 12 tokens) runs ``--steps`` steps

- ``plain``:   the demo's GRPO objective,
- ``add``:     the same plus ``algo.distill.coef=--coef`` with the teacher (reward advantage + teacher),
- ``replace``: pure on-policy distillation (``algo.distill.mode=replace``, filtering off: every group
  carries the teacher's signal),

for each of ``--seeds``; same data, same held-out set (``--eval-size`` problems, greedy). Prints
per run the held-out accuracy after the stage and the last step's reverse KL to the teacher; the
last line is one JSON object: ``{"accuracy_student_start", "accuracy_teacher", "accuracy_plain",
"accuracy_add", "paired_gain_add_points", "accuracy_replace", ...}`` (means over seeds).

    python benchmarks/distillation.py [--steps 30] [--seeds 1 2] [--eval-every 0] [--work runs/bench_distill]

``--eval-every N`` also scores the held-out set every N steps of each run (``accuracy_<kind>_step<N>``,
``paired_gain_<kind>_step<N>_points``), so one longer run gives the shorter horizons too.
``--distill-override KEY=VALUE ...`` sets config keys for the distillation runs only (checked before any run;
they name the run directories, so the plain GRPO runs are shared), e.g. ``policy.optim.clip_grad=10``.

Finished runs are kept in ``--work`` and reused. The box is shared: the load average is printed.
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
CONFIG = REPO / "configs" / "demo_cpu.yaml"
STAGE = "stage1_12"
sys.path.insert(0, str(REPO))  # run as `python benchmarks/distillation.py`: the project's argument parser


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def train(run_dir: Path, overrides: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="2", VLLM_ENABLE_V1_MULTIPROCESSING="0", WANDB_MODE="disabled",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           "--stage", STAGE, "tracking.wandb_mode=disabled", "tracking.console=false", "trainer.save_every=0",
           *overrides]
    if run_dir.exists():  # an unfinished run: start afresh
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}); see {run_dir.parent / (run_dir.name + '.log')}")
    return time.perf_counter() - t0


def sft_run(work: Path, who: str, eval_size: int, extra: list[str]) -> Path:
    run = work / who
    if not (run / STAGE / "final" / "trainer_state.json").exists():
        print(f"SFT ({who}) into {run} ...", flush=True)
        s = train(run, ["stages.0.max_steps=1", f"synthetic.eval_size={eval_size}", "eval.every=0", *extra])
        print(f"  {s:.0f} s (load {loadavg()})", flush=True)
    return run


def accuracy(run: Path, key: str) -> float:
    return json.loads((run / "run_state.json").read_text())["eval"][key]["eval/accuracy"]


def main() -> None:
    from megatron_rl.common.cli_args import ArgumentParser

    p = ArgumentParser(prog="python benchmarks/distillation.py", command="distillation")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--teacher-stop", type=float, default=0.95)
    p.add_argument("--coef", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", choices=("add", "replace"), default=["add", "replace"])
    p.add_argument("--distill-override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for the distillation runs only (e.g. policy.optim.clip_grad=10); "
                        "they name the runs, so plain GRPO runs are shared")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also score the held-out set every this many steps (0: only at the end)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_distill")
    args = p.parse_args()
    from megatron_rl.trainer.schema import load_run_config

    # the distillation runs' overrides, checked now: a bad key is one line here, not a failed run after the SFT
    load_run_config(CONFIG, list(args.distill_override)).stage(STAGE)
    print(f"load average before: {loadavg()}", flush=True)
    student = sft_run(args.work, "student", args.eval_size, [])
    teacher_name = "teacher" if args.teacher_stop == 0.7 else f"teacher_stop{args.teacher_stop:g}"
    teacher = sft_run(args.work, teacher_name, args.eval_size,
                      [f"sft.stop_accuracy={args.teacher_stop}", "sft.max_steps=4000", "sft.slow_down_at=1.0"])
    teacher_hf = teacher / STAGE / "final" / "hf"
    acc_student, acc_teacher = accuracy(student, "start"), accuracy(teacher, STAGE)
    print(f"held-out accuracy: student (SFT) {acc_student:.3f}, teacher {acc_teacher:.3f}", flush=True)
    data = student / "data"
    runs: dict[tuple[str, int], dict] = {}
    kinds = ["plain", *args.modes]
    for seed in args.seeds:
        for kind in kinds:
            tag = "".join(f"_{o.replace('=', '')}" for o in args.distill_override)
            run = args.work / (f"plain_seed{seed}" if kind == "plain" else
                               f"distill_{teacher_name}_coef{args.coef:g}_{kind}{tag}_seed{seed}")
            if not (run / STAGE / "final" / "trainer_state.json").exists():
                over = ["sft.enabled=false", f"trainer.init_from={student / 'sft' / 'final'}", f"trainer.seed={seed}",
                        f"model.path={student / 'base_model'}", "synthetic.enabled=false",
                        f"data.train_path={data / 'train.jsonl'}", f"eval.path={data / 'eval.jsonl'}",
                        f"stages.0.max_steps={args.steps}", f"eval.every={args.eval_every}"]
                if kind != "plain":
                    over += [f"algo.distill.coef={args.coef}", f"algo.distill.mode={kind}",
                             f"algo.distill.teacher={teacher_hf}"]
                    if kind == "replace":
                        over.append("algo.filter_zero_variance_groups=false")
                    over += args.distill_override
                s = train(run, over)
                print(f"  {kind} seed {seed}: {s:.0f} s (load {loadavg()})", flush=True)
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
            rows = [r for r in rows if r["stage"] == STAGE]
            curve = {r["step"] - rows[0]["step"] + 1: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
            runs[kind, seed] = {"accuracy": accuracy(run, STAGE), "steps": len(rows), "curve": curve,
                                "reverse_kl_last": rows[-1].get("distill/reverse_kl"),
                                "reward_last10": statistics.mean(r["reward/mean"] for r in rows[-10:]),
                                "wall_s": sum(r["timing/step"] for r in rows)}
            mid = "".join(f"{a:.3f} at step {k}, " for k, a in sorted(curve.items()))
            print(f"  {kind} seed {seed}: held-out {mid}{runs[kind, seed]['accuracy']:.3f} at the end, "
                  f"reward (last 10 steps) {runs[kind, seed]['reward_last10']:.3f}, reverse KL at the last "
                  f"step {runs[kind, seed]['reverse_kl_last']}", flush=True)
    out = {"accuracy_student_start": acc_student, "accuracy_teacher": acc_teacher,
           "teacher_stop": args.teacher_stop, "steps": args.steps, "seeds": args.seeds, "coef": args.coef,
           "distill_override": args.distill_override,
           "eval_n": args.eval_size}
    for kind in kinds:
        out[f"accuracy_{kind}"] = statistics.mean(runs[kind, s]["accuracy"] for s in args.seeds)
        out[f"wall_{kind}_s"] = statistics.mean(runs[kind, s]["wall_s"] for s in args.seeds)
        if kind != "plain":
            gains = [runs[kind, s]["accuracy"] - runs["plain", s]["accuracy"] for s in args.seeds]
            out[f"paired_gain_{kind}_points"] = [round(100 * g, 1) for g in gains]
            out[f"mean_gain_{kind}_points"] = 100 * statistics.mean(gains)
        for step in sorted(runs[kind, args.seeds[0]]["curve"]):
            at = [runs[kind, s]["curve"].get(step) for s in args.seeds]
            base = [runs["plain", s]["curve"].get(step) for s in args.seeds]
            if None not in at:
                out[f"accuracy_{kind}_step{step}"] = statistics.mean(at)
                if kind != "plain" and None not in base:
                    out[f"paired_gain_{kind}_step{step}_points"] = [round(100 * (a - b), 1) for a, b in zip(at, base)]
    out["load"] = loadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    from megatron_rl.common.cli_args import run_main

    sys.exit(run_main(main))
