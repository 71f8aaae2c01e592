"""Every config key does something: changing it changes what its section produces.

The walk enumerates every leaf key of the run config (``RunConfig``, with ``model.tiny`` and one
stage expanded) and fails on a key without a probe here (a new key must say what it changes) and on
a key whose probe sees no difference. A probe changes one key (after optional ``given`` overrides
that make the key matter, e.g. ``algo.kl.enabled`` for ``algo.kl.coef``) and compares its section's
observable before and after:

* the algorithm, rollout sampling, trainer, SFT, evaluation, stage and sync keys: the transcript of
  a whole run of the real trainer (``fake_run.py``: SFT, stages, evaluation, checkpoints) with a
  bigram model in place of Megatron and vLLM;
* data: the records the run loads; rewards: the scores (and what reaches the pool, math-verify, the
  sandboxed program, the judge server); tracking: what W&B is started with and the files written;
  the demo's inputs: the files written;
* ``policy.*``: with the real Megatron policy in ``tests/integration/models/test_policy_keys_act.py``;
* the rollout engines' set-up, placement, timeouts, dispatch and the weight transfer's keys
  (``FLEET_KEYS``, in ``fleet_keys.py``): on real vLLM servers in
  ``tests/integration/rollout/test_fleet.py`` (an engine in the trainer's process gets the tensors
  directly whatever sync.transport says).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

import fake_run
from fleet_keys import FLEET_KEYS
from megatron_rl.config.reference import leaf_keys
from megatron_rl.envs.registry import ENVIRONMENTS
from megatron_rl.rewards.base import REWARD_STYLES
from megatron_rl.trainer.schema import RunConfig, load_run_config

# walked by tests/integration/models/test_policy_keys_act.py and, on a real OpenEnv server,
# tests/integration/envs/test_openenv_service.py
INTEGRATION_SECTIONS = ("policy.", "envs.services.")


@dataclass
class Probe:
    value: Any  # the changed value (an override string's right-hand side)
    observe: Callable[[RunConfig, Path], Any]
    given: list[str] = field(default_factory=list)  # overrides that make the key matter


# ------------------------------------------------------------------------------- the fake run
def base_overrides(tmp: Path) -> list[str]:
    data, held_out = tmp / "data" / "train.jsonl", tmp / "data" / "eval.jsonl"
    if not held_out.exists():
        fake_run.write_data(data, 40)
        fake_run.write_data(held_out, 6, offset=100)
    return [
        f"model.path={tmp / 'model'}", f"data.train_path={data}", f"eval.path={held_out}",
        "reward.style_map={mapped_source: math}", "reward.default_style=exact_boxed",
        f"trainer.run_dir={tmp / 'run'}", "tracking.wandb_mode=disabled", "tracking.console=false",
        "rollout.rollout_batch_size=4", "rollout.group_size=3", "rollout.max_prompt_len=40",
        "stages=[{name: s1, max_response_len: 5, max_steps: 2}, {name: s2, max_response_len: 6, max_steps: 1}]",
        "eval.size=3", "policy.optim.lr=0.5", "sft.batch_size=6", "sft.eval_size=3",
        "sft.eval_every=2", "sft.max_steps=3", "sft.lr=0.5", "sft.stop_accuracy=1.0",
    ]


def run_fake(cfg: RunConfig, tmp: Path, *, drop_version: bool = False, stale: bool = False,
             preempt_after: int | None = None, observed: bool = False, on_step=None) -> dict:
    """A whole run (``trainer.run.run``) on the fakes; returns its transcript."""
    from megatron_rl.algo import EntropyController
    from megatron_rl.demo.tiny import build_char_tokenizer
    from megatron_rl.rewards import RewardManager
    from megatron_rl.sync.base import build_weight_sync
    from megatron_rl.tracking import Tracker
    from megatron_rl.trainer.context import Context, load_run_data, open_envs
    from megatron_rl.trainer.run import run
    from megatron_rl.trainer.state import RunDir
    from megatron_rl.trainer.stop import StopRequest

    tok = build_char_tokenizer()
    model_dir = Path(cfg.model.path)
    if not model_dir.exists():
        tok.save_pretrained(model_dir)
    log = fake_run.Log()
    stop = StopRequest()

    def preempt(steps: int) -> None:  # as SIGUSR1 would: finish the step, checkpoint, exit 99
        if on_step is not None:
            on_step(steps)
        if preempt_after is not None and steps >= preempt_after:
            stop.requested = True

    policy = fake_run.BigramPolicy(len(tok), log, on_step=preempt)
    policy.lr = cfg.policy.optim.lr  # as the Megatron policy's optimizer starts
    kind = fake_run.BigramStream if cfg.rollout.async_.needs_streaming else fake_run.BigramEngine
    engine = kind(policy.theta, tok.eos_token_id, log, tok, drop_version=drop_version, stale=stale)
    train, sft, held_out = load_run_data(cfg, tok)
    root = Path(cfg.trainer.run_dir)
    ctx = Context(cfg=cfg, run=RunDir(root), groups=fake_run.Groups(), policy=policy, tokenizer=tok,
                  model_path=str(model_dir), entropy_ctl=EntropyController(cfg.algo.entropy),
                  stop=stop, engine=engine,
                  reward_mgr=RewardManager(cfg.reward), train_records=train, sft_records=sft,
                  eval_records=held_out, envs=open_envs(cfg, tok, train, sft, held_out),
                  tracker=Tracker(cfg.tracking, root, cfg.to_dict()))
    if observed:  # the rollout dumps, W&B sample table and wrong-label monitor
        from megatron_rl.trainer.context import build_observer

        ctx.observer = build_observer(cfg, root, ctx.tracker)
    if cfg.algo.kl.enabled:  # a frozen copy of the start (the real one is Megatron: integration)
        ctx.reference = fake_run.BigramPolicy(len(tok), fake_run.Log(), seed=1)
    if cfg.algo.distill.enabled:  # a bigram teacher whose weights the checkpoint path names
        ctx.teacher = fake_run.BigramPolicy(len(tok), fake_run.Log(),
                                            seed=zlib.crc32(cfg.algo.distill.teacher.encode()) % 997)
    ctx.export_plan = policy.export_plan()
    ctx.weight_sync = build_weight_sync(cfg.sync, engine, metadata=ctx.export_plan)
    ctx.weight_sync.connect()
    try:
        code: Any = run(ctx)
    except Exception as exc:  # noqa: BLE001 - what a run raises is part of what it does
        code = f"{type(exc).__name__}: {exc}"
    return {"code": code, **fake_run.transcript(log, root)}


def observe_run(cfg: RunConfig, tmp: Path):
    return run_fake(cfg, tmp)


def observe_dumps(cfg: RunConfig, tmp: Path):
    """What the step observer leaves: the rollout dumps' rows (token ids included when dumped),
    the wrong-label report, the W&B sample tables, and the run's transcript."""
    import pandas as pd

    out = run_fake(cfg, tmp, observed=True)
    root = Path(cfg.trainer.run_dir)
    dumps = sorted((root / "rollouts").glob("step_*.parquet"))
    rows = [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()}
            for p in dumps for r in pd.read_parquet(p).to_dict("records")]
    labels = root / "rollouts" / "wrong_labels.json"
    report = json.loads(labels.read_text()) if labels.exists() else None
    tables = sorted(p.name for p in root.rglob("*.table.json"))
    return {**out, "dumps": repr(rows), "labels": report, "tables": tables,
            "bytes": sum(p.stat().st_size > 0 for p in dumps)}


def observe_run_broken_engine(cfg: RunConfig, tmp: Path):
    return run_fake(cfg, tmp, drop_version=True)


def observe_run_stale_engine(cfg: RunConfig, tmp: Path):
    """An engine that reports the new version but keeps computing with the old weights."""
    return run_fake(cfg, tmp, stale=True)


def observe_send_plan(cfg: RunConfig, tmp: Path):
    """Who sends what in a sync at pipeline_parallel=2 (the trainer's plan for its sync.senders; the
    real export plan over a two-stage layout: sync.senders changes which ranks send)."""
    from megatron_rl.models.hf_config import HFArch
    from megatron_rl.models.hf_export import export_plan
    from megatron_rl.models.parallel import ParallelGroups

    arch = HFArch(model_type="llama", vocab_size=16, hidden_size=8, ffn_hidden_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=2, head_dim=4, rope_theta=1e4, rms_eps=1e-6, tie_embeddings=False, qkv_bias=False,
                  qk_norm=False, max_position_embeddings=32)
    groups = ParallelGroups(world_size=2, rank=0, tp=1, pp=2, dp=1, vpp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                            tp_group=None, pp_group=None, dp_group=None, pp_ranks=(0, 1), tp_ranks=(0,),
                            backend="gloo", device=torch.device("cpu"), timeout_s=1.0, generation=0)
    plan = export_plan(arch, groups, torch.float32, to_rank=cfg.sync.gather_rank())
    return [(item.name, item.sender) for item in plan]


def observe_preempted(cfg: RunConfig, tmp: Path):
    """A run stopped by a signal mid-stage leaves its newest checkpoints."""
    return run_fake(cfg, tmp, preempt_after=3)


def observe_run_dir(cfg: RunConfig, tmp: Path):
    """Where the run's files land."""
    run_fake(cfg, tmp)
    root = Path(cfg.trainer.run_dir)
    return root.name, sorted(p.name for p in root.iterdir())


def observe_console(cfg: RunConfig, tmp: Path):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron_rl")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        run_fake(cfg, tmp)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [r.getMessage() for r in records if r.getMessage().startswith("[s")]


def observe_wandb(cfg: RunConfig, tmp: Path, monkeypatch=None):
    import wandb

    calls = []

    class _Run:
        id = "walk"
        summary: dict = {}

        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    original = wandb.init
    wandb.init = lambda **kw: calls.append({k: v for k, v in kw.items() if k != "settings"
                                            and k != "config"}) or _Run()
    try:
        run_fake(cfg, tmp)
    finally:
        wandb.init = original
    return calls


def observe_teacher_build(cfg: RunConfig, tmp: Path):
    """What the distillation teacher is built from: ``trainer.teacher.ensure_teacher`` with the
    model builder at its boundary (the real build is Megatron's: tests/e2e)."""
    from megatron_rl.demo.tiny import build_char_tokenizer
    from megatron_rl.models import reference
    from megatron_rl.trainer import teacher

    asked = []
    built = SimpleNamespace(arch=SimpleNamespace(model_type="llama", num_layers=1, hidden_size=8),
                            offload=False)
    real, read = reference.ReferencePolicy.from_hf, teacher.check_teacher_tokenizer
    reference.ReferencePolicy.from_hf = lambda path, policy, groups, **kw: asked.append((path, kw)) or built
    teacher.check_teacher_tokenizer = lambda *a: None
    ctx = SimpleNamespace(cfg=cfg, teacher=None, groups=None, tokenizer=build_char_tokenizer())
    try:
        from megatron_rl.models import hf_config

        vocab, hf_config.read_hf_config = hf_config.read_hf_config, lambda p: SimpleNamespace(vocab_size=99)
        try:
            teacher.ensure_teacher(ctx)
        finally:
            hf_config.read_hf_config = vocab
    finally:
        reference.ReferencePolicy.from_hf, teacher.check_teacher_tokenizer = real, read
    return asked


def observe_init_from(cfg: RunConfig, tmp: Path):
    """Needs a finished run to start from: the base run's last stage's final checkpoint."""
    return run_fake(cfg, tmp)["log"][:3]


# ------------------------------------------------------------------------------- data and rewards
def observe_data(cfg: RunConfig, tmp: Path):
    from megatron_rl.demo.tiny import build_char_tokenizer
    from megatron_rl.trainer.context import load_run_data

    try:
        train, sft, held_out = load_run_data(cfg, build_char_tokenizer())
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return [(r.prompt_ids, r.prompt_text, r.ground_truth, r.style, r.data_source, r.extra, r.env)
            for r in train + sft + held_out]


REWARD_ITEMS = [
    # (response, ground truth, style, data source)
    ("\\boxed{12.5\\%}", "12.5", "math", "m"), ("\\boxed{\\pi}", "3.14", "math", "m"),
    ("we get 3 then 1,234 apples", "1234", "math", "m"),
    ("\\boxed{7}", "7", "unregistered", "mapped_source"),
    ("\\boxed{7}", "7", "other_unregistered", "other"),
]


def _reward_items(cfg: RunConfig | None = None):
    """The fixed items, and one per user function (reward.functions) when the config has some."""
    from megatron_rl.rewards import RewardItem

    user = [(f"{'x' * 9} {s}", "3", s, "u") for s in (cfg.reward.functions if cfg else {})]
    return [RewardItem(r, g, s, {"data_source": d, "question": "q", "extra_info": {"w": 0.5}})
            for r, g, s, d in REWARD_ITEMS + user]


# A user reward function (reward.functions), written where a probe names it ({walk}/user_reward.py).
USER_REWARD = """
def score(response, ground_truth, extra_info):
    print("scoring " * 40)
    return extra_info["w"] * len(response) / 10
"""
USER_FN = ["reward.functions={walk_user: '{walk}/user_reward.py:score'}"]


def observe_rewards(cfg: RunConfig, tmp: Path):
    """Scores through the manager, the math style in this process (what a pool worker calls)."""
    import math_verify

    from megatron_rl.rewards import RewardManager, pool

    seen = []

    for target in cfg.reward.functions.values():  # the user's file, where the config names it
        path = Path(target.rsplit(":", 1)[0])
        if not path.exists():
            path.write_text(USER_REWARD)

    class _Pool:  # the process pool at its boundary: what the manager asks of it
        def __init__(self, n, preload=(), memory_mb=0, start_timeout_s=0.0, setup=()):
            seen.append(("pool", n, memory_mb, start_timeout_s, setup))
            self.restarts = 0

        def run(self, tasks):
            seen.append(("timeouts", [t for _, _, t in tasks]))
            return [pool.TaskResult("ok", fn(*args)) for fn, args, _ in tasks]

        def close(self):
            pass

    parse, verify = math_verify.parse, math_verify.verify  # math-verify at its boundary
    math_verify.parse = lambda *a, **k: seen.append(("parse", k)) or parse(*a, **k)
    math_verify.verify = lambda *a, **k: seen.append(("verify", k)) or verify(*a, **k)
    from megatron_rl.rewards import manager

    real_pool = manager.HardTimeoutPool
    manager.HardTimeoutPool = _Pool
    try:
        mgr = RewardManager(cfg.reward)
        try:
            scores, _, details = mgr.score(_reward_items(cfg), return_details=True)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}", seen
    finally:
        manager.HardTimeoutPool = real_pool
        math_verify.parse, math_verify.verify = parse, verify
        for style in cfg.reward.functions:  # the registry as it was (the next probes' styles)
            REWARD_STYLES.unregister(style)
    return scores, [(d["status"], d["detail"] if d["style"] in cfg.reward.functions else "") for d in details], seen


PROGRAM = """import os, resource, sys
print(os.getuid(), resource.getrlimit(resource.RLIMIT_CPU), resource.getrlimit(resource.RLIMIT_AS),
      resource.getrlimit(resource.RLIMIT_NPROC), resource.getrlimit(resource.RLIMIT_FSIZE),
      os.statvfs('.').f_blocks * os.statvfs('.').f_frsize, sys.executable)
print('x' * 3000)
"""


def observe_code(cfg: RunConfig, tmp: Path):
    """What a sandboxed program sees (its uid, limits, disk, interpreter, output) and the scores
    of responses against test cases."""
    from megatron_rl.rewards import RewardItem
    from megatron_rl.rewards import sandbox as sb
    from megatron_rl.rewards.code import code_reward

    out = []
    try:
        box = sb.Sandbox(cfg.reward.code.sandbox)
        res = box.run_python(PROGRAM)
        uid = int(res.stdout.split()[0]) if res.stdout else None
        out.append((uid if cfg.reward.code.sandbox.uid_span == 1 else uid is not None,
                    res.stdout.split("\n")[0].split(" ", 1)[-1], len(res.stdout), res.timed_out))
    except Exception as exc:  # noqa: BLE001
        out.append(f"{type(exc).__name__}: {exc}")
    cases = {"inputs": ["1", "2", "3"], "outputs": ["0", "2", "3"]}  # the first case fails
    program = "```python\nprint(input())\n```"
    # the style itself, in this process (what a pool worker runs; the pool is walked above)
    try:
        outcome = code_reward(RewardItem(program, cases, "code"), cfg.reward)
        out.append((outcome.score, outcome.status, outcome.extracted))
    except Exception as exc:  # noqa: BLE001
        out.append(f"{type(exc).__name__}: {exc}")
    return out


def observe_sandbox_timeout(cfg: RunConfig, tmp: Path):
    from megatron_rl.rewards import sandbox as sb

    return sb.Sandbox(cfg.reward.code.sandbox).run_python("import time; time.sleep(0.4)").timed_out


def observe_code_without_isolation(cfg: RunConfig, tmp: Path):
    from megatron_rl.rewards import sandbox as sb

    real = sb.isolation_mode, sb.isolation_problem
    sb.isolation_mode, sb.isolation_problem = (lambda *a, **k: "none"), (lambda *a, **k: "no bwrap")
    try:
        sb.Sandbox(cfg.reward.code.sandbox)
        return "started"
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    finally:
        sb.isolation_mode, sb.isolation_problem = real


class _JudgeServer(BaseHTTPRequestHandler):
    seen: list = []
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        import time

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        cls.seen.append((body["model"], body["max_tokens"], self.headers.get("Authorization")))
        time.sleep(0.15)
        with cls.lock:
            cls.in_flight -= 1
        try:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"choices": [{"message": {"content": "VERDICT: CORRECT"}}]}).encode())
        except BrokenPipeError:
            pass

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def observe_judge(cfg: RunConfig, tmp: Path):
    from megatron_rl.rewards import RewardItem, RewardManager

    _JudgeServer.seen, _JudgeServer.peak = [], 0
    items = [RewardItem("\\boxed{twelve}", "12", "exact_boxed", {"question": "q"}) for _ in range(3)]
    items += [RewardItem("\\boxed{12}", "12", "exact_boxed", {"question": "q"})]
    items += [RewardItem("\\boxed{x}", "12", "boxed_final", {"question": "q"})]
    mgr = RewardManager(cfg.reward)
    try:
        scores, m = mgr.score(items)
    finally:
        mgr.close()
    return scores, sorted(set(_JudgeServer.seen)), _JudgeServer.peak, m.get("reward/judge_calls")


# ------------------------------------------------------------------------------- CPU placement
def observe_cpu_placement(cfg: RunConfig, tmp: Path):
    """The entry point's placement (``cli.place_cpus``) in a child process: its CPUs and the helpers'."""
    import os
    import subprocess

    code = ("import json, os, sys; from megatron_rl.cli import place_cpus; "
            "from megatron_rl.trainer.schema import RunConfig; "
            "cfg = RunConfig.from_dict(json.loads(sys.argv[1])); "
            "cfg.trainer.cpu_cores and place_cpus(cfg); "
            "print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ.get('MRL_HELPER_CPUS')]))")
    env = {k: v for k, v in os.environ.items() if k != "MRL_HELPER_CPUS"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg.to_dict())], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stderr[-300:]


USER_ENV = """
from megatron_rl.envs import Environment, StepResult, ToolOutput

class Echo(Environment):
    def step(self, turn):
        if self.calls:
            return StepResult(done=True)
        return self.use_tool("echo", lambda: ToolOutput(turn[::-1]))
"""


def observe_user_env(cfg: RunConfig, tmp: Path):
    """A whole run (``observe_run``) with the environments of envs.classes, written where the config
    names them; the registry as it was afterwards (the next runs' environments)."""
    for target in cfg.envs.classes.values():
        path = Path(target.rsplit(":", 1)[0])
        if not path.exists():
            path.write_text(USER_ENV)
    try:
        return run_fake(cfg, tmp)
    finally:
        for name in cfg.envs.classes:
            ENVIRONMENTS.unregister(name)


def observe_tool_pool(cfg: RunConfig, tmp: Path):
    """What a sandboxed tool call asks of its process pool (at the pool's boundary: the program runs
    in this process's sandbox) and what the model reads back."""
    from megatron_rl.envs import Environments
    from megatron_rl.rewards import pool

    seen = []

    class _Pool:
        def __init__(self, n, preload=(), memory_mb=0, start_timeout_s=0.0):
            seen.append(("pool", n, preload))

        def run(self, tasks):
            seen.append(("timeouts", [t for _, _, t in tasks]))
            return [pool.TaskResult("ok", fn(*args)) for fn, args, _ in tasks]

        def close(self):
            pass

    real, pool.HardTimeoutPool = pool.HardTimeoutPool, _Pool
    envs = Environments(cfg.envs, None, max_turns=cfg.rollout.max_turns, sandbox=cfg.reward.code.sandbox)
    try:
        out = envs.tools.run_python("print(6 * 7)")
    finally:
        envs.close()
        pool.HardTimeoutPool = real
    return seen, out


# ------------------------------------------------------------------------------- demo inputs
def observe_demo_inputs(cfg: RunConfig, tmp: Path):
    from safetensors.torch import load_file

    from megatron_rl.demo import prepare_inputs, tiny_model_dir

    root = Path(cfg.trainer.run_dir)
    prepare_inputs(root, tiny=None if cfg.model.path else cfg.model.tiny, synthetic=cfg.synthetic,
                   seed=cfg.trainer.seed)
    out = {"files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())}
    from megatron_rl.cli import model_dir

    out["model_dir"] = model_dir(cfg) == str(tiny_model_dir(root))
    model = tiny_model_dir(root)
    if (model / "config.json").exists():
        out["config"] = json.loads((model / "config.json").read_text())
        out["weights"] = {k: float(v.double().sum()) for k, v in
                          load_file(str(model / "model.safetensors")).items()}
    for split in ("train", "eval"):
        f = root / "data" / f"{split}.jsonl"
        if f.exists():
            out[split] = f.read_text()
    return out


def observe_labels(cfg: RunConfig, tmp: Path):
    """The wrong-label report at the end of a run, without its echo of the rule's settings."""
    report = observe_dumps(cfg, tmp)["labels"]
    if report is not None:
        report.pop("rule")
    return report


def observe_labels_written(cfg: RunConfig, tmp: Path):
    """At each optimizer step, the step of the wrong-label report on disk (None: none yet)."""
    labels = Path(cfg.trainer.run_dir) / "rollouts" / "wrong_labels.json"
    seen = []
    run_fake(cfg, tmp, observed=True, on_step=lambda _: seen.append(
        json.loads(labels.read_text())["step"] if labels.exists() else None))
    return seen


def observe_library_console(cfg: RunConfig, tmp: Path):
    """What reaches the console of a library's INFO line once the entry point routed the logs
    (``cli._train``: ``route_logs(..., verbose=tracking.console_libraries)``)."""
    import io
    import logging

    from megatron_rl.tracking.logs import route_logs

    root, screen = logging.getLogger(), io.StringIO()
    libs = [logging.getLogger(n) for n in ("vllm", "transformers")]
    saved = (root.handlers[:], root.level, [(lg.handlers[:], lg.propagate, lg.level) for lg in libs])
    root.handlers = [logging.StreamHandler(screen)]  # the console
    try:
        route_logs(tmp / "logs_run", verbose=cfg.tracking.console_libraries)
        logging.getLogger("vllm.engine").info("an engine line")
        logging.getLogger("megatron_rl").info("a trainer line")
    finally:  # the process's logging as it was
        for h in root.handlers:
            h.close()
        root.handlers, root.level = saved[0], saved[1]
        for lg, (handlers, propagate, level) in zip(libs, saved[2]):
            lg.handlers, lg.propagate, lg.level = handlers, propagate, level
        logging.captureWarnings(False)
    return screen.getvalue()


def observe_route_server_args(cfg: RunConfig, tmp: Path):
    """The command line a node's server would run with on a GPU node (MoE routing replay: the
    routes' worker extension, vLLM's own routed-experts output)."""
    from megatron_rl.trainer.engines import node_launcher

    launcher = node_launcher(cfg, str(tmp / "model"), node="n", host="127.0.0.1", count=1, gpus_per_engine=1)
    return launcher.servers[0].spec.command()[1:]


# ------------------------------------------------------------------------------- the probes
R, D, RW, C, J, RB = observe_run, observe_data, observe_rewards, observe_code, observe_judge, \
    observe_run_broken_engine
DUMPS, LBL = observe_dumps, observe_labels
OFF = ["algo.n_sgd=2", "policy.optim.lr=3.0"]  # a second pass far from the first: ratios move
TINY = ['model.path=""', "model.tiny={hidden_size: 64, intermediate_size: 48, num_layers: 1, "
        "num_heads: 2, num_kv_heads: 2}"]
ONE = ["data.style_key=data_source"]  # exact_boxed: every answer unparsable, no group varies
# evaluations at steps 1, 2, 3 of a four-step stage, on which the model scores (accuracy > 0)
PLATEAU = ["eval.every=1", "algo.correct_reward=0.3",
           "stages=[{name: s1, max_response_len: 5, max_steps: 4}]"]
# Four prompts seen every step (nine samples each by the end), every prompt labelled; the policy's
# pass rate on the source (~0.25) does not stop suspects.
WL = ["data.max_rows=4", "data.wrong_labels.min_samples=3", "data.wrong_labels.window=0",
      "data.wrong_labels.min_source_pass_rate=0.0", "data.wrong_labels.suspect_max_pass_rate=0.4"]
# every prompt multi-turn (two tool calls, then the answer), with room for a few turns
ENV = [f"envs.default_env={fake_run.ENV}", "stages=[{name: s1, max_response_len: 100, max_steps: 2}]"]
PASSK = ["algo.adv_estimator=passk", "algo.passk.k=3", "algo.correct_reward=0.6"]
DISTILL = ["algo.distill.coef=1.0", "algo.distill.teacher={walk}/teacher_a"]
SERVERS = ["rollout.engine=vllm_server", "sync.transport=gloo"]
JUDGE = ["reward.judge.mode=main", "reward.judge.base_url={judge}", "reward.judge.model=j",
         "reward.judge.styles=[exact_boxed]"]

PROBES: dict[str, Probe] = {
    # the algorithm: the transcript of a run (advantages, filtering, losses, schedule, updates)
    "algo.adv_estimator": Probe("dr_grpo", R),
    "algo.norm_adv_by_std": Probe("false", R),
    "algo.adv_eps": Probe("0.5", R),
    "algo.truncation_mask": Probe("after", R),
    "algo.filter_zero_variance_groups": Probe("false", R, ONE),
    "algo.correct_reward": Probe("0.5", R),
    "algo.wrong_reward": Probe("0.7", R),  # a group of equal fractional rewards counts as all-wrong
    "algo.policy_loss": Probe("reinforce", R),
    "algo.clip.eps_low": Probe("0.01", R, OFF),
    "algo.clip.eps_high": Probe("0.02", R, [*OFF, "algo.clip.eps_low=0.01"]),
    "algo.clip.dual_clip_c": Probe("1.5", R, OFF),
    "algo.loss_agg": Probe("seq-mean-token-mean", R),
    "algo.entropy.mode": Probe("fixed", R, ["algo.entropy.coef=0.01"]),
    "algo.entropy.coef": Probe("0.04", R, ["algo.entropy.mode=fixed"]),
    "algo.entropy.target": Probe("5.0", R, ["algo.entropy.mode=adaptive"]),
    "algo.entropy.delta": Probe("0.02", R, ["algo.entropy.mode=adaptive", "algo.entropy.target=9.0"]),
    "algo.entropy.coef_min": Probe("0.003", R, ["algo.entropy.mode=adaptive", "algo.entropy.coef=0.005"]),
    "algo.entropy.coef_max": Probe("0.001", R, ["algo.entropy.mode=adaptive", "algo.entropy.target=9.0"]),
    "algo.entropy.estimator": Probe("sampled", R, ["algo.entropy.mode=fixed", "algo.entropy.coef=0.01"]),
    "algo.kl.enabled": Probe("true", R),
    "algo.kl.estimator": Probe("k1", R, ["algo.kl.enabled=true"]),
    "algo.kl.coef": Probe("0.5", R, ["algo.kl.enabled=true"]),
    "algo.kl.as_reward": Probe("true", R, ["algo.kl.enabled=true"]),
    "algo.mismatch.mode": Probe("tis_token", R),
    "algo.mismatch.tis_cap": Probe("1.01", R, ["algo.mismatch.mode=tis_token"]),
    "algo.mismatch.icepop_low": Probe("0.99", R, ["algo.mismatch.mode=icepop"]),
    "algo.mismatch.icepop_high": Probe("1.01", R, ["algo.mismatch.mode=icepop"]),
    "algo.n_sgd": Probe("2", R),
    "algo.mini_batches": Probe("2", R),
    # issue 29 / 31 variants: the decoupled objective, pass@k, reward shapers, token masks, distillation
    "algo.decoupled.cap": Probe("1.01", R, ["algo.policy_loss=decoupled_ppo"]),
    "algo.decoupled.over_cap": Probe("mask", R, ["algo.policy_loss=decoupled_ppo", "algo.decoupled.cap=1.01"]),
    "algo.passk.k": Probe("2", R, PASSK),
    "algo.shaping.shapers": Probe("[overlong, length_penalty]", R),
    "algo.shaping.overlong_buffer": Probe("2", R, ["algo.shaping.shapers=[overlong]"]),
    "algo.shaping.overlong_penalty": Probe("0.3", R, ["algo.shaping.shapers=[overlong]"]),
    "algo.shaping.length_coef": Probe("0.5", R, ["algo.shaping.shapers=[length_penalty]"]),
    "algo.token_mask.mode": Probe("high_entropy", R),
    "algo.token_mask.frac": Probe("0.5", R, ["algo.token_mask.mode=low_entropy"]),
    "algo.distill.coef": Probe("0.2", R, DISTILL),
    "algo.distill.mode": Probe("replace", R, DISTILL),
    "algo.distill.teacher": Probe("{walk}/teacher_b", R, DISTILL),
    "algo.distill.offload": Probe("true", observe_teacher_build, DISTILL),
    # rollout sampling: what the engine is asked for, and what the run does with it
    "rollout.rollout_batch_size": Probe("2", R),
    "rollout.group_size": Probe("2", R),
    "rollout.temperature": Probe("0.7", R),
    "rollout.top_p": Probe("0.5", R),
    "rollout.top_k": Probe("3", R),
    "rollout.max_prompt_len": Probe("10", D),
    # the response length of a stage that does not set its own
    "rollout.max_response_len": Probe("2", R, ["stages=[{name: s1, max_steps: 2}, {name: s2, max_response_len: 6, max_steps: 1}]"]),
    "rollout.eval_max_tokens": Probe("3", R),
    "rollout.max_turns": Probe("2", R, ENV),
    # asynchronous GRPO: which weights sampled what, how many prompts are drawn
    "rollout.async.max_staleness": Probe("1", R),
    "rollout.async.oversample": Probe("0.5", R),
    "rollout.async.dynamic_sampling": Probe("true", R),
    "rollout.async.max_draw_factor": Probe("1.0", R, ["rollout.async.dynamic_sampling=true"]),
    # the trainer
    "trainer.run_dir": Probe("{tmp}/elsewhere", observe_run_dir),
    "trainer.seed": Probe("7", R),
    "trainer.save_every": Probe("1", R),
    "trainer.keep_checkpoints": Probe("1", observe_preempted, [
        "trainer.save_every=1", "stages=[{name: s1, max_response_len: 5, max_steps: 5}]"]),
    "trainer.init_from": Probe("{base_final}", observe_init_from),
    "trainer.max_steps_without_update": Probe("1", R, ONE),
    "trainer.cpu_cores": Probe("[0]", observe_cpu_placement),
    "sft.enabled": Probe("true", R),
    "sft.max_steps": Probe("2", R, ["sft.enabled=true"]),
    "sft.batch_size": Probe("4", R, ["sft.enabled=true"]),
    "sft.lr": Probe("0.1", R, ["sft.enabled=true"]),
    "sft.slow_down_factor": Probe("0.5", R, ["sft.enabled=true", "sft.slow_down_at=0.0"]),
    "sft.slow_down_at": Probe("0.0", R, ["sft.enabled=true"]),
    "sft.eval_every": Probe("1", R, ["sft.enabled=true"]),
    "sft.eval_size": Probe("2", R, ["sft.enabled=true"]),
    "sft.stop_accuracy": Probe("0.0", R, ["sft.enabled=true"]),
    "sft.max_seconds": Probe("1.0e-9", R, ["sft.enabled=true"]),
    "sft.control": Probe("true", R, ["sft.enabled=true"]),
    "sft.data_path": Probe("{walk}/data/eval.jsonl", R, ["sft.enabled=true"]),
    "eval.path": Probe('""', R),
    "eval.size": Probe("2", R),
    "eval.every": Probe("1", R),
    "stages.0.name": Probe("first", R),
    "stages.0.max_response_len": Probe("4", R),
    "stages.0.max_steps": Probe("1", R),
    "stages.0.plateau.patience": Probe("1", R, PLATEAU),
    "stages.0.plateau.min_delta": Probe("2.0", R, [*PLATEAU, "stages.0.plateau.patience=1"]),
    "stages.0.lr": Probe("0.01", R),
    # the first stage starts from the SFT cold start's result: its weights only, a new optimizer
    "stages.0.optimizer_state": Probe("fresh", R, ["sft.enabled=true"]),
    # the weight sync: a broken engine (never reports the loaded version) is caught by verify
    "sync.verify": Probe("false", RB),
    "sync.probe_tolerance": Probe("100.0", observe_run_stale_engine),
    "sync.senders": Probe("gather", observe_send_plan),
    # data
    "data.train_path": Probe("{walk}/data/eval.jsonl", D),
    "data.prompt_key": Probe("data_source", D),
    "data.ground_truth_key": Probe("extra_info.index", D),
    "data.style_key": Probe("data_source", D),
    "data.data_source_key": Probe("reward_model.style", D),
    "data.extra_key": Probe("reward_model", D),
    "data.chat_template": Probe("never", D),
    "data.system_prompt": Probe("Think.", D, ["data.chat_template=never"]),
    "data.max_prompt_len": Probe("10", D),
    "data.on_bad_row": Probe("skip", D, ["data.prompt_key=nope"]),
    "data.max_rows": Probe("3", D),
    "data.keep_labels": Probe("[mixed]", D),
    "data.pass_rate_min": Probe("0.5", D),
    "data.pass_rate_max": Probe("0.5", D),
    # the wrong-label monitor: its report (labels, suspects, hard prompts, the rule's map)
    "data.wrong_labels.enabled": Probe("false", LBL, WL),
    "data.wrong_labels.window": Probe("3", LBL, WL),
    "data.wrong_labels.min_samples": Probe("7", LBL, [*WL, "stages=[{name: s1, max_response_len: 5, max_steps: 2}]"]),
    "data.wrong_labels.agree_frac": Probe("0.9", LBL, WL),
    "data.wrong_labels.hard_max_pass_rate": Probe("0.9", LBL, WL),
    "data.wrong_labels.suspect_max_pass_rate": Probe("0.0", LBL, WL),
    "data.wrong_labels.min_source_pass_rate": Probe("0.9", LBL, WL),
    "data.wrong_labels.source_window": Probe("3", LBL, WL),
    "data.wrong_labels.hard_examples": Probe("0", LBL, [*WL, "data.wrong_labels.hard_max_pass_rate=0.9"]),
    "data.wrong_labels.write_every": Probe("1", observe_labels_written, [
        *WL, "stages=[{name: s1, max_response_len: 5, max_steps: 5}]"]),
    "data.wrong_labels.points_max": Probe("2", LBL, WL),
    # environments: which prompts are multi-turn, and their tools' limits
    "envs.default_env": Probe(fake_run.ENV, R),
    "envs.env_map": Probe(f"{{walk: {fake_run.ENV}}}", R),
    "envs.max_tool_calls": Probe("1", R, ENV),
    "envs.tool_timeout_s": Probe("0.01", R, ENV),
    "envs.max_observation_chars": Probe("16", R, ENV),
    "envs.num_workers": Probe("1", observe_tool_pool),
    # the data's source "walk" names the user's environment: every prompt multi-turn
    "envs.classes": Probe("{walk: '{walk}/user_env.py:Echo'}", observe_user_env,
                          ["stages=[{name: s1, max_response_len: 100, max_steps: 2}]"]),
    "data.env_key": Probe("data_source", D),
    # rewards
    "reward.num_workers": Probe("1", RW),
    "reward.worker_memory_mb": Probe("1024", RW),
    "reward.worker_start_timeout_s": Probe("7.0", RW),
    "reward.style_map": Probe("{mapped_source: exact_boxed}", RW),
    "reward.default_style": Probe("math", RW),
    "reward.functions": Probe("{walk_user: '{walk}/user_reward.py:score'}", RW),
    "reward.user.timeout_s": Probe("3.0", RW, USER_FN),
    "reward.user.in_process": Probe("[walk_user]", RW, USER_FN),
    "reward.user.max_output_chars": Probe("10", RW, USER_FN),
    "reward.math.timeout_s": Probe("3.0", RW),
    "reward.math.parse_timeout_s": Probe("1", RW),
    "reward.math.verify_timeout_s": Probe("2", RW),
    "reward.math.percent_equivalence": Probe("false", RW),
    "reward.math.pi_tolerance": Probe("false", RW),
    "reward.math.fallback_last_number": Probe("true", RW),
    "reward.code.mode": Probe("all_pass", C),
    "reward.code.timeout_s": Probe("0.25", C, ["reward.code.sandbox.timeout_s=0.2"]),
    "reward.code.stop_on_first_failure": Probe("false", C, ["reward.code.mode=all_pass"]),
    "reward.code.max_cases": Probe("1", C),
    "reward.code.sandbox.timeout_s": Probe("0.2", observe_sandbox_timeout),
    "reward.code.sandbox.cpu_s": Probe("3", C),
    "reward.code.sandbox.memory_mb": Probe("256", C),
    "reward.code.sandbox.max_procs": Probe("4", C),
    "reward.code.sandbox.file_size_mb": Probe("8", C),
    "reward.code.sandbox.disk_mb": Probe("32", C),
    "reward.code.sandbox.max_output_bytes": Probe("100", C),
    "reward.code.sandbox.python": Probe("{python}", C),
    "reward.code.sandbox.require_isolation": Probe("false", observe_code_without_isolation),
    "reward.code.sandbox.uid_base": Probe("300000", C, ["reward.code.sandbox.uid_span=1"]),
    "reward.code.sandbox.uid_span": Probe("1", C),
    "reward.code.sandbox.work_root": Probe("/nonexistent/work", C),
    "reward.judge.mode": Probe("fallback", J, JUDGE),
    "reward.judge.base_url": Probe("http://127.0.0.1:9/v1", J, JUDGE),
    "reward.judge.model": Probe("other", J, JUDGE),
    "reward.judge.api_key_env": Probe("HOME", J, JUDGE),
    "reward.judge.timeout_s": Probe("0.05", J, JUDGE),
    "reward.judge.max_concurrency": Probe("1", J, JUDGE),
    "reward.judge.max_tokens": Probe("9", J, JUDGE),
    "reward.judge.styles": Probe("[boxed_final]", J, JUDGE),
    # MoE routing replay: the engines asked for each token's routes (a GPU node's servers: vLLM's
    # own routed-experts output); what the trainer's passes replay is walked with the real MoE
    # policy (tests/integration/trainer/test_routing_replay_trainer.py)
    "algo.routing_replay": Probe("r3", observe_route_server_args, SERVERS),
    "algo.router_agreement": Probe("true", observe_route_server_args, SERVERS),
    "rollout.routes_source": Probe("capture", observe_route_server_args, SERVERS + ["algo.router_agreement=true"]),
    # tracking
    "tracking.wandb_mode": Probe("offline", observe_wandb),
    "tracking.wandb_project": Probe("p2", observe_wandb, ["tracking.wandb_mode=offline"]),
    "tracking.wandb_name": Probe("n2", observe_wandb, ["tracking.wandb_mode=offline"]),
    "tracking.wandb_entity": Probe("e2", observe_wandb, ["tracking.wandb_mode=offline"]),
    "tracking.console": Probe("true", observe_console),
    "tracking.jsonl": Probe("false", R),
    "tracking.console_libraries": Probe("true", observe_library_console),
    "tracking.rollouts.enabled": Probe("false", DUMPS),
    "tracking.rollouts.sample_rate": Probe("0.5", DUMPS),
    "tracking.rollouts.max_gb": Probe("1.0e-9", DUMPS),
    "tracking.rollouts.token_ids": Probe("false", DUMPS),
    "tracking.rollouts.wandb_samples": Probe("0", DUMPS, ["tracking.wandb_mode=offline"]),
    # the demo's inputs: the tiny model and the synthetic task written into the run dir
    "model.path": Probe("{tmp}/model", observe_demo_inputs, TINY),
    **{f"model.tiny.{k}": Probe(v, observe_demo_inputs, TINY) for k, v in {
        "arch": "qwen2", "hidden_size": "96", "intermediate_size": "64", "num_layers": "2",
        "num_heads": "4", "num_kv_heads": "1", "max_position_embeddings": "64",
        "tie_word_embeddings": "true", "vocab_multiple": "64", "seed": "5"}.items()},
    # the expert keys act on a Mixture-of-Experts arch (the shared expert's on qwen2_moe only)
    **{f"model.tiny.{k}": Probe(v, observe_demo_inputs, TINY + [f"model.tiny.arch={arch}"])
       for k, v, arch in (("num_experts", "4", "qwen3_moe"), ("num_experts_per_tok", "1", "qwen3_moe"),
                          ("moe_intermediate_size", "32", "qwen3_moe"),
                          ("shared_expert_intermediate_size", "32", "qwen2_moe"))},
    "synthetic.enabled": Probe("true", observe_demo_inputs, ["synthetic.train_size=30",
                                                            "synthetic.eval_size=4"]),
    **{f"synthetic.{k}": Probe(v, observe_demo_inputs, ["synthetic.enabled=true",
                                                        "synthetic.train_size=30", "synthetic.eval_size=4"])
       for k, v in {"train_size": "31", "eval_size": "5", "min_digits": "1", "max_digits": "2",
                    "sft_size": "5", "wrong_label_fraction": "0.2", "hard_fraction": "0.2",
                    "task": "multiplication", "env": "calculator"}.items()},
}


def test_every_key_has_a_probe():
    keys = leaf_keys(RunConfig)
    missing = [k for k in keys if k not in PROBES and k not in FLEET_KEYS
               and not k.startswith(INTEGRATION_SECTIONS)]
    assert not missing, (f"config keys without a probe in {__file__}: {missing}. Say what each "
                         f"changes (a Probe: the changed value and the section's observable)")
    stale = sorted((set(PROBES) | FLEET_KEYS) - set(keys))
    assert not stale, f"probes for keys that no longer exist: {stale}"
    both = sorted(set(PROBES) & FLEET_KEYS)
    assert not both, f"keys walked here and on the fleet (fleet_keys.py): {both}"


def _config(overrides: list[str], tmp: Path, extra: dict) -> RunConfig:
    def fill(o: str) -> str:
        for name, value in {"tmp": str(tmp), **extra}.items():
            o = o.replace("{" + name + "}", value)
        return o

    return load_run_config(None, [fill(o) for o in overrides])


@pytest.fixture(scope="module")
def walk_dir(tmp_path_factory):
    """One data set and model directory for the whole walk, and no run report (seconds per run
    that no key drives)."""
    import megatron_rl.analysis as analysis

    analyze, analysis.analyze = analysis.analyze, lambda root: {"report": None}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only spin
    yield tmp_path_factory.mktemp("walk")
    torch.set_num_threads(threads)
    analysis.analyze = analyze


_SEEN: dict = {}  # (observer, overrides) -> observation: the unchanged side is shared by probes


@pytest.mark.parametrize("key", sorted(PROBES))
def test_changing_the_key_changes_what_it_drives(key, walk_dir, tmp_path, judge_url):
    probe = PROBES[key]
    extra = {"judge": judge_url, "base_final": "", "walk": str(walk_dir), "python": sys.executable}
    given = base_overrides(walk_dir) + probe.given
    if key == "trainer.init_from":  # a finished run to start from
        first = _config(given, tmp_path / "first", extra)
        first = dataclasses.replace(first, trainer=dataclasses.replace(
            first.trainer, run_dir=str(tmp_path / "first_run")))
        run_fake(first, tmp_path)
        extra["base_final"] = str(tmp_path / "first_run" / "s2" / "final")
    memo = (probe.observe.__name__, tuple(given), key == "trainer.init_from")
    if memo not in _SEEN:
        base = _config(given, walk_dir, extra)
        base = dataclasses.replace(base, trainer=dataclasses.replace(
            base.trainer, run_dir=str(tmp_path / "run_a")))
        _SEEN[memo] = probe.observe(base, tmp_path / "a")
    before = _SEEN[memo]
    changed = _config(given + [f"{key}={probe.value}"], tmp_path, extra)
    if key != "trainer.run_dir":
        changed = dataclasses.replace(changed, trainer=dataclasses.replace(
            changed.trainer, run_dir=str(tmp_path / "run_b")))
    after = probe.observe(changed, tmp_path / "b")
    assert before != after, f"{key}={probe.value} changed nothing its probe observes"
