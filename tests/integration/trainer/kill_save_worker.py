"""kill -9 at every moment of a save: the worker behind test_checkpoint_atomic.py.

Usage: python kill_save_worker.py MODEL_DIR WORK_DIR OUT.json

The operation under test is the end of a stage whose run directory holds complete step
checkpoints 1 and 2 and an older ``final``: a periodic save of step 3 (which prunes step 1,
``trainer.keep_checkpoints=2``), then the stage's final checkpoint with its HF export replacing
the older one, then the removal of the step checkpoints. It runs with the real single-rank
Megatron policy, never stepped (so every checkpoint here is one written before any optimizer step),
in forked children with their own process group and one-rank world (gloo's threads do not survive
a fork, so this parent starts no world until the children are done).

A file-system event is a directory made, renamed or deleted, a file opened for writing, its first
write, an fsync or a torch.save, in the child or in Megatron's forked shard writers.

* Every moment: one child runs the operation and, just before each event, copies the run directory
  aside. kill -9 loses nothing already written, so each copy is exactly what a kill at that moment
  leaves behind.
* Real kills: for a few of those events, a child runs the operation again and SIGKILLs its whole
  process group (the shard writers too) just before that event; what it leaves must look the same
  to a restart as the copy taken at that moment.

Then, for every copy and every killed directory, the parent does what a restart does
(``RunDir.recover``) and records every directory resume could take as complete: whether it is
intact, whether it loads into the policy, and what resume would choose.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

STAGE = "s1"
# Real kills, just before: the first shard write of the periodic save, its trainer state, its
# commit, the prune, the final's replacement (between its two renames), an unlink in the middle of
# deleting the step checkpoints.
REAL_KILLS = [("first_write", "step_000003.partial/policy/__0_0.distcp"),
              ("replace", "step_000003.partial/trainer_state.json"),
              ("rename", "checkpoints/.step_000003.partial"),
              ("rename", "checkpoints/step_000001"),
              ("rename", "s1/.final.partial"),
              ("unlink", "")]


def _setup(model_dir: Path):
    """World, policy and a context factory (in the process that calls it)."""
    from megatron_rl.algo import EntropyController
    from megatron_rl.algo.config import EntropyConfig
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, PolicyConfig, init_distributed
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.trainer.config import StageConfig
    from megatron_rl.trainer.context import Context
    from megatron_rl.trainer.schema import ModelConfig, RunConfig
    from megatron_rl.trainer.state import RunDir
    from megatron_rl.trainer.stop import StopRequest

    apply_compat()
    groups = init_distributed(ParallelConfig())
    policy = MegatronPolicy.from_hf(str(model_dir), PolicyConfig(), groups)
    stage = StageConfig(name=STAGE, max_response_len=4, max_steps=3)
    cfg = RunConfig(model=ModelConfig(path=str(model_dir)), stages=[stage])
    cfg.trainer.keep_checkpoints = 2

    def context(run_dir: Path) -> Context:
        return Context(cfg=cfg, run=RunDir(run_dir), groups=groups, policy=policy, tokenizer=None,
                       model_path=str(model_dir), entropy_ctl=EntropyController(EntropyConfig()),
                       stop=StopRequest())

    return stage, context


def _make_base(model_dir: Path, base: Path) -> None:
    from megatron_rl.trainer import checkpointing as ck
    from megatron_rl.trainer.state import TrainerState

    stage, context = _setup(model_dir)
    ctx = context(base)
    ck.write_checkpoint(ctx, ctx.run.final_dir(STAGE), TrainerState(stage=STAGE, step=100), None,
                        also=lambda d: ck.export_hf(ctx, d / "hf"))
    for step in (1, 2):
        ck.save_checkpoint(ctx, stage, TrainerState(stage=STAGE, step=step), None)


class Events:
    """Counts file-system events of the armed child and its forked children; before each, either
    copies the run directory aside or, at ``kill_at``, SIGKILLs the child's process group."""

    def __init__(self):
        self.armed = False
        self.run_dir: Path | None = None
        self.copies: Path | None = None  # copy mode
        self.kill_at = 0  # kill mode
        self.counter = None
        self.log_fd = -1
        self._busy = False

    def arm(self, run_dir: Path, copies: Path | None, kill_at: int, log: Path) -> None:
        self.run_dir, self.copies, self.kill_at = run_dir, copies, kill_at
        self.counter = multiprocessing.Value(ctypes.c_long, 0)
        self.log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.armed = True

    def __call__(self, kind: str, path) -> None:
        if not self.armed or self._busy:
            return
        self._busy = True
        try:
            with self.counter.get_lock():
                self.counter.value += 1
                k = self.counter.value
                where = str(path).replace("\t", " ").replace("\n", " ")
                os.write(self.log_fd, f"{k}\t{kind}\t{where}\n".encode())
                if self.copies is not None:
                    shutil.copytree(self.run_dir, self.copies / f"{k:04d}", symlinks=True)
            if k == self.kill_at:
                os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            self._busy = False


EVENTS = Events()


def _install_hooks() -> None:
    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            EVENTS(kind, args[0] if args else "")
            return fn(*args, **kwargs)

        return wrapper

    class File:
        def __init__(self, f, name):
            self._f, self._name, self._written = f, name, False

        def write(self, data):
            if not self._written:
                self._written = True
                EVENTS("first_write", self._name)
            return self._f.write(data)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __iter__(self):
            return iter(self._f)

        def __getattr__(self, name):
            return getattr(self._f, name)

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and EVENTS.armed and not EVENTS._busy:
            EVENTS("open", file)
            return File(real_open(file, mode, *args, **kwargs), file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = open_
    for name in ("rename", "replace", "mkdir", "fsync", "unlink", "rmdir"):
        setattr(os, name, counted(name, getattr(os, name)))
    shutil.rmtree = counted("rmtree", shutil.rmtree)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # to a file; Megatron's writers also save into memory
        if isinstance(f, str | os.PathLike):
            EVENTS("torch.save", f)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _operation(model_dir: Path, run_dir: Path, copies: Path | None, kill_at: int, log: Path) -> None:
    from megatron_rl.trainer import checkpointing as ck
    from megatron_rl.trainer.state import TrainerState

    stage, context = _setup(model_dir)
    c = context(run_dir)
    state = TrainerState(stage=STAGE, step=3)
    EVENTS.arm(run_dir, copies, kill_at, log)
    ck.save_checkpoint(c, stage, state, None)
    ck.finish_stage(c, stage, state, None)


def _in_child(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child with its own process group; its wait status."""
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        code = 0
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported through the exit code
            print(f"child failed: {exc!r}", file=sys.stderr, flush=True)
            code = 3
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers of its group, if any
    except (ProcessLookupError, PermissionError):
        pass
    return status


def _real_kill_points(events: list[tuple[int, str, str]]) -> list[int]:
    """The events REAL_KILLS names (an unlink: the third one after the last rmtree started)."""
    points = []
    last_rmtree = max(k for k, kind, _ in events if kind == "rmtree")
    for kind, where in REAL_KILLS:
        if kind == "unlink":
            hits = [k for k, kd, _ in events if kd == kind and k > last_rmtree][2:3]
        else:
            hits = [k for k, kd, path in events if kd == kind and where in path][:1]
        points += [k for k in hits if k not in points]
    return points


def main() -> None:
    model_dir, work, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    import megatron_rl.trainer.checkpointing  # noqa: F401 - imported once, shared by the children

    filesystem_async._get_write_results_queue()  # Megatron's writer queue: started once, here
    _install_hooks()
    base = work / "base"
    if _in_child(_make_base, model_dir, base) != 0:
        raise SystemExit("could not write the starting run directory")

    copies = work / "copies"
    copies.mkdir()
    every = work / "every"
    shutil.copytree(base, every, symlinks=True)
    log = work / "events.tsv"
    if _in_child(_operation, model_dir, every, copies, 0, log) != 0:
        raise SystemExit("the operation failed")
    events = [(int(k), kind, path) for k, kind, path in
              (line.split("\t", 2) for line in log.read_text().splitlines())]
    killed = {}
    for k in _real_kill_points(events):
        run_dir = work / f"killed_{k:04d}"
        shutil.copytree(base, run_dir, symlinks=True)
        status = _in_child(_operation, model_dir, run_dir, None, k, work / f"killed_{k:04d}.tsv")
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            raise SystemExit(f"kill point {k}: the child was not killed (status {status})")
        killed[k] = run_dir

    _, context = _setup(model_dir)
    loaded: dict[tuple, dict] = {}  # one load check per distinct set of complete directories
    results = []
    for k, kind, _ in events:
        results.append({"k": k, "event": kind, **_inspect(context(copies / f"{k:04d}"), loaded)})
    results.append({"k": len(events) + 1, "event": "end", **_inspect(context(every), loaded)})
    real = [{"k": k, **_inspect(context(d), loaded)} for k, d in killed.items()]
    out.write_text(json.dumps({"moments": results, "real_kills": real}, indent=1))
    torch.distributed.destroy_process_group()


def _inspect(ctx, loaded: dict) -> dict:
    """What a restart sees: recover, then every directory resume could take as complete, whether
    it is intact (and loads), and what the stage would resume from."""
    from megatron_rl.trainer import checkpointing as ck
    from megatron_rl.trainer.state import RunDir, checkpoint_damage

    run = ctx.run
    run.recover()
    leftovers = sorted(str(p.relative_to(run.root)) for p in run.root.rglob(".*")
                       if p.name.endswith(".partial") or ".trash-" in p.name)
    candidates = run.step_checkpoints(STAGE)
    final = run.final_dir(STAGE)
    if RunDir.is_complete(final):
        candidates.append(final)
    seen = {}
    for ckpt in candidates:
        name = str(ckpt.relative_to(run.root))
        entry = {"damage": checkpoint_damage(ckpt), "step": RunDir.read_state(ckpt).step}
        if ckpt == final:
            entry["hf"] = (final / "hf" / "model.safetensors").is_file()
        seen[name] = entry
    signature = tuple(sorted((n, e["step"]) for n, e in seen.items()))
    if signature not in loaded:
        loaded[signature] = {}
        for ckpt in candidates:
            name = str(ckpt.relative_to(run.root))
            if seen[name]["damage"] is None:
                try:
                    ctx.policy.load_checkpoint(str(ckpt / "policy"))
                    loaded[signature][name] = True
                except BaseException as exc:  # noqa: BLE001 - reported
                    loaded[signature][name] = f"{type(exc).__name__}: {exc}"
    for name, ok in loaded[signature].items():
        seen[name]["loads"] = ok
    resume = ck.resume_point(ctx, STAGE)
    return {"complete": seen, "resume": str(resume.relative_to(run.root)) if resume else None,
            "leftovers": leftovers}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
