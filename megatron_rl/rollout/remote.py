"""A vLLM engine in its own process, driven over a pipe; every wait has a timeout.

The child process hosts a :class:`~megatron_rl.rollout.vllm_engine.VLLMEngine` (in-process vLLM
core, so vLLM's worker lives in that child) and serves one request at a time. The parent-side
:class:`RemoteEngine` implements :class:`RolloutEngine` by forwarding calls, and exposes
``submit(...)`` so the weight sync can start a long call (receive the weights) on every engine,
drive the transfer itself, and then collect the replies. A child that dies is reported by name,
pid and exit code as soon as it is noticed, never as a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any, Callable, Iterable

import torch

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig


class EngineError(RuntimeError):
    """The remote engine failed, died or did not answer in time."""


class EngineDied(EngineError):
    pass


class EngineTimeout(EngineError):
    pass


# ------------------------------------------------------------------------------------ child side
def _rpc(engine, fn: Callable, args: tuple) -> list:
    return engine.llm.collective_rpc(fn, args=args)


def _set_version(engine, version: int) -> None:
    engine.weight_version = version


_COMMANDS: dict[str, Callable] = {
    "generate": lambda e, prompts, sampling: e.generate(prompts, sampling),
    "update_weights": lambda e, named, version: e.update_weights(named, version),
    "reset_prefix_cache": lambda e: e.reset_prefix_cache(),
    "sleep": lambda e: e.sleep(),
    "wake_up": lambda e: e.wake_up(),
    "rpc": _rpc,
    "set_weight_version": _set_version,
    "ping": lambda e: os.getpid(),
}


def _vllm_engine(model_path: str, cfg: RolloutConfig, **kwargs):
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, cfg, **kwargs)


# Set by torchrun for the trainer's world; an engine spawned from a trainer rank is its own world.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def _serve(conn, model_path: str, cfg: dict, seed: int, max_model_len: int | None, name: str,
           env: dict[str, str], factory: Callable) -> None:
    for var in _LAUNCHER_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        engine = factory(model_path, RolloutConfig.from_dict(cfg), seed=seed,
                         max_model_len=max_model_len, name=name)
    except BaseException:  # noqa: BLE001 - report the start-up failure to the parent, then exit
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:  # parent gone
            return
        if cmd == "close":
            conn.send(("ok", None))
            engine.close()
            return
        try:
            conn.send(("ok", _COMMANDS[cmd](engine, *args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the caller
            conn.send(("error", traceback.format_exc()))


# ----------------------------------------------------------------------------------- parent side
class Pending:
    """One request in flight; ``result`` waits for it with a timeout."""

    def __init__(self, engine: "RemoteEngine", cmd: str):
        self.engine, self.cmd = engine, cmd
        self._done, self._value = False, None

    def poll(self) -> bool:
        """True once the reply is in; raises at once if it is an error or the engine died."""
        if not self._done:
            self._receive(0.0)
        return self._done

    def result(self, timeout_s: float) -> Any:
        if not self._done:
            self._receive(timeout_s)
            if not self._done:
                raise EngineTimeout(f"engine {self.engine.name}: no reply to {self.cmd!r} "
                                    f"within {timeout_s:.1f}s")
        return self._value

    def _receive(self, timeout_s: float) -> None:
        eng = self.engine
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready = eng._conn.poll(min(0.05, max(0.0, deadline - time.monotonic())))
                if ready:
                    status, value = eng._conn.recv()
                    break
            except (EOFError, OSError):
                eng._raise_died(self.cmd)
            if not eng._proc.is_alive():
                eng._raise_died(self.cmd)
            if time.monotonic() >= deadline:
                return
        self._done = True
        if eng._pending is self:
            eng._pending = None
        if status != "ok":
            raise EngineError(f"engine {eng.name}: {self.cmd!r} failed in the engine process:\n{value}")
        self._value = value


class RemoteEngine(RolloutEngine):
    """A rollout engine in a child process (spawned), addressed by ``name``."""

    def __init__(self, model_path: str, cfg: RolloutConfig, *, seed: int = 0,
                 max_model_len: int | None = None, name: str = "engine0",
                 env: dict[str, str] | None = None, start_timeout_s: float = 300.0,
                 wait: bool = True, factory: Callable | None = None):
        """``factory(model_path, cfg, seed=, max_model_len=, name=)`` builds the engine in the
        child (a module-level function; default: :class:`VLLMEngine`). ``env`` is applied in the
        child before anything is imported there."""
        cfg.validate()
        self.cfg, self.name, self.weight_version = cfg, name, 0
        # Ranks this engine takes in a sync group: one per vLLM worker.
        self.workers = cfg.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name=f"mrl-{name}", daemon=True,
                                 args=(child, model_path, cfg.to_dict(), seed, max_model_len, name,
                                       dict(env or {}), factory or _vllm_engine))
        self._proc.start()
        child.close()
        self._pending: Pending | None = Pending(self, "start")
        self.pid = self._proc.pid
        self._start_timeout_s = start_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float | None = None) -> "RemoteEngine":
        """Block until the engine has started (``wait=False`` lets several engines boot at once)."""
        if self._pending is not None and self._pending.cmd == "start":
            self._pending.result(timeout_s or self._start_timeout_s)
        return self

    # -- plumbing
    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def _raise_died(self, cmd: str):
        self._proc.join(timeout=1.0)
        raise EngineDied(f"engine {self.name} (pid {self._proc.pid}) died during {cmd!r}, "
                         f"exit code {self._proc.exitcode}")

    def submit(self, cmd: str, *args, drain_timeout_s: float | None = None) -> Pending:
        """Send a request without waiting; an unread earlier reply is drained (and discarded) first."""
        if self._pending is not None:
            try:
                self._pending.result(drain_timeout_s if drain_timeout_s is not None else self.cfg.timeout_s)
            except EngineDied:
                raise
            except EngineError:  # the earlier request's own failure was already reported
                pass
        try:
            self._conn.send((cmd, args))
        except (BrokenPipeError, OSError):
            self._raise_died(cmd)
        self._pending = Pending(self, cmd)
        return self._pending

    def call(self, cmd: str, *args, timeout_s: float | None = None) -> Any:
        return self.submit(cmd, *args).result(timeout_s or self.cfg.timeout_s)

    # -- RolloutEngine
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        return self.call("generate", prompt_ids, sampling)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        named = [(n, t.detach().cpu().contiguous()) for n, t in named_tensors]
        out = self.call("update_weights", named, version)
        self.weight_version = version
        return out

    def set_weight_version(self, version: int, timeout_s: float | None = None) -> None:
        self.call("set_weight_version", version, timeout_s=timeout_s)
        self.weight_version = version

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache")

    def rpc(self, fn: Callable, *args, timeout_s: float | None = None) -> list:
        """``llm.collective_rpc(fn, args)`` in the engine process; one result per vLLM worker."""
        return self.call("rpc", fn, args, timeout_s=timeout_s)

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def kill(self) -> None:
        """SIGKILL the engine process (tests: a crash mid-sync)."""
        if self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(timeout=10)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.is_alive():
            try:
                self.submit("close", drain_timeout_s=timeout_s).result(timeout_s)
            except EngineError:
                pass
            self._proc.join(timeout=timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()
