"""Chaos: a training run on three vLLM servers that a schedule keeps breaking, against the same run
unbroken.

`megatron-rl train` (the CPU miniature: tiny model, synthetic task, no cold start) drives three vLLM
servers it starts itself (``rollout.placement=colocated``, ``engines_per_node=3``: its own launcher
supervises them, as on a node). Once step 3k is logged, fault k hits server (k - 1) mod 3 (or, when
that one is being restarted, another registered one), mid-way into the next step's generation, in turn:

- ``kill -9`` of its whole process group (a lost node): the launcher restarts it;
- ``SIGTERM`` to its process group: vLLM then refuses connections and never exits; the launcher must
  treat it as terminating (kill, restart);
- ``SIGSTOP`` for ``--stop-s`` seconds, then ``SIGCONT`` (a hung engine): its requests are hedged or
  time out (``rollout.timeout_s``) and go elsewhere; it rejoins at a later sync.

Restarts take longer than three steps here, so faults overlap and the fleet at times has no engine
left: the run must wait for restarts (``rollout/revivals``). Then the same run without faults, and a
comparison of what both trained on: every step's samples (the rollout dumps: prompt, sample, response
tokens) must be equal, since a re-sent request keeps its seed and a restarted engine serves only
once it holds the verified current weights.

Prints the steps each run completed, the faults, the re-sent requests, revivals, hedged requests,
the launcher's restarts and whether the trained samples are equal; the last line is one JSON object.

    python benchmarks/chaos.py                      # 30 steps, a fault every 3 (~10 min on 2 cores)
    python benchmarks/chaos.py --steps 9 --every 3  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAULTS = ("kill", "term", "stop")
STAGE = "s1"


def overrides(steps: int, timeout_s: float) -> list[str]:
    return [
        "synthetic.min_digits=1", "synthetic.max_digits=1", "synthetic.train_size=60", "synthetic.eval_size=5",
        "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=128", "model.tiny.num_layers=2", "sft.enabled=false",
        "rollout.rollout_batch_size=8", "rollout.group_size=4", "rollout.kv_cache_bytes=16777216",
        f"stages=[{{name: {STAGE}, max_response_len: 16, max_steps: {steps}}}]", "eval.every=0",
        "tracking.wandb_mode=disabled", "tracking.console=false", "algo.filter_zero_variance_groups=false",
        "rollout.engine=vllm_server", "rollout.placement=colocated", "rollout.engines_per_node=3",
        "rollout.num_engines=3", "rollout.max_num_seqs=16", f"rollout.timeout_s={timeout_s:g}",
        "rollout.control_timeout_s=10", "rollout.start_timeout_s=600", "sync.transport=gloo",
        "sync.bucket_bytes=65536", f"sync.timeout_s={timeout_s:g}", "sync.retries=2",
    ]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # being written
            pass
    return [r for r in out if r.get("stage") == STAGE]


def servers(run_dir: Path) -> dict[str, int]:
    """Engine name -> pid (its process group) from the run's registry."""
    out = {}
    for p in sorted((run_dir / "engines").glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except ValueError:
            continue
        out[rec["name"]] = rec["pid"]
    return out


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def train(run_dir: Path, args, faults: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "MRL_NODE_NAME": "chaos", "MRL_NODE_HOST": "127.0.0.1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/demo_cpu.yaml"),
           "--run-dir", str(run_dir), *overrides(args.steps, args.timeout_s)]
    t0 = time.monotonic()
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    done: list[dict] = []
    timers: list[threading.Timer] = []
    try:
        k = 0
        while proc.poll() is None:
            if time.monotonic() - t0 > args.limit_s:
                raise TimeoutError(f"{run_dir.name}: not finished within {args.limit_s:g}s")
            steps = len({r["step"] for r in metrics(run_dir)})
            if faults and steps >= args.every * (k + 1) and steps < args.steps:
                time.sleep(args.delay_s)  # into the next step's generation
                live = servers(run_dir)  # registered: up (one being restarted is not)
                names = sorted(live)
                kind = FAULTS[k % len(FAULTS)]
                name = f"chaos-{k % 3}" if f"chaos-{k % 3}" in live or not names else names[k % len(names)]
                pid = live.get(name)
                if pid is not None:
                    if kind == "kill":
                        signal_group(pid, signal.SIGKILL)
                    elif kind == "term":
                        signal_group(pid, signal.SIGTERM)
                    else:
                        signal_group(pid, signal.SIGSTOP)
                        timers.append(threading.Timer(args.stop_s, signal_group, (pid, signal.SIGCONT)))
                        timers[-1].start()
                done.append({"after_step": steps, "kind": kind, "server": name, "pid": pid,
                             "registered": names, "t": round(time.monotonic() - t0, 1)})
                print(f"# fault {k + 1}: {kind} {name} (pid {pid}) after step {steps}, "
                      f"{time.monotonic() - t0:.0f}s into the run", flush=True)
                k += 1
            time.sleep(0.1)
    finally:
        for t in timers:
            t.cancel()
        for pid in servers(run_dir).values():
            signal_group(pid, signal.SIGCONT)
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    rows = metrics(run_dir)
    last = {r["step"]: r for r in rows}

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in last.values())

    return {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "steps": len(last),
            "faults": done, "requeued": total("rollout/requeued_requests"), "revivals": total("rollout/revivals"),
            "hedged": total("rollout/hedged_requests"), "sync_attempts": total("sync/attempts"),
            "engines_up_min": min((r.get("rollout/engines_up", 0) for r in last.values()), default=0),
            "restarts": restarts(run_dir)}


def restarts(run_dir: Path) -> int:
    """Servers the run's launcher restarted (its warnings, in the run's output or its log files)."""
    files = [run_dir.parent / f"{run_dir.name}.out", *(run_dir / "logs").glob("*.log")]
    return max((sum("restarting it" in line for line in f.read_text(errors="replace").splitlines())
                for f in files if f.exists()), default=0)


def samples(run_dir: Path) -> dict:
    from megatron_rl.tracking.rollouts import read_rollouts

    df = read_rollouts(run_dir, columns=["global_step", "prompt_uid", "sample", "response_ids", "weight_version"])
    if df is None:
        return {}
    return {(int(r.global_step), r.prompt_uid, int(r.sample)): (list(r.response_ids), int(r.weight_version))
            for r in df.itertuples()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=3, help="a fault once every this many steps")
    ap.add_argument("--stop-s", type=float, default=12.0, help="how long a SIGSTOPped server stays stopped")
    ap.add_argument("--delay-s", type=float, default=0.3, help="fault this long after a step is logged")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="rollout.timeout_s and sync.timeout_s")
    ap.add_argument("--limit-s", type=float, default=1800.0, help="give a run up after this long")
    ap.add_argument("--work-dir", default="/tmp/mrl_chaos")
    args = ap.parse_args()
    work = Path(args.work_dir)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    print(f"# {args.steps} steps, a fault every {args.every}; load average {os.getloadavg()[0]:.1f}", flush=True)
    faulted = train(work / "faulted", args, faults=True)
    print(f"# faulted run: rc {faulted['rc']}, {faulted['steps']} steps in {faulted['seconds']}s; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    clean = train(work / "clean", args, faults=False)
    print(f"# unfaulted run: rc {clean['rc']}, {clean['steps']} steps in {clean['seconds']}s", flush=True)
    a, b = samples(work / "faulted"), samples(work / "clean")
    equal = bool(a) and a == b
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    print("\n| run | rc | steps | s | faults | re-sent requests | revivals | hedged | sync attempts | "
          "launcher restarts | fewest engines up |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in (("faulted", faulted), ("unfaulted", clean)):
        print(f"| {name} | {r['rc']} | {r['steps']} | {r['seconds']} | {len(r['faults'])} | {r['requeued']:.0f} | "
              f"{r['revivals']:.0f} | {r['hedged']:.0f} | {r['sync_attempts']:.0f} | {r['restarts']} | "
              f"{r['engines_up_min']:.0f} |")
    for f in faulted["faults"]:
        print(f"- after step {f['after_step']} (+{f['t']}s): {f['kind']} {f['server']} (pid {f['pid']})")
    print(f"trained samples equal the unfaulted run's: {equal} ({len(a)} samples; "
          f"{len(differ)} differ{': first ' + str(differ[:3]) if differ else ''})")
    print(json.dumps({"steps": faulted["steps"], "steps_unfaulted": clean["steps"], "faults": len(faulted["faults"]),
                      "requeued": faulted["requeued"], "revivals": faulted["revivals"],
                      "restarts": faulted["restarts"], "samples_equal": equal, "samples": len(a),
                      "rc": faulted["rc"], "seconds": faulted["seconds"]}))


if __name__ == "__main__":
    main()
