"""Run untrusted programs (model-written code) contained.

Layers, strongest available first (``Sandbox.mode`` says which one is active):

* ``root_ns`` (running as root, `unshare` + `setpriv` present): new network, PID and mount
  namespaces; fresh tmpfs over every world-writable directory (/tmp, /var/tmp, /dev/shm,
  /run/lock); the program runs as a private uid drawn per run (so RLIMIT_NPROC counts only its own
  processes: root ignores RLIMIT_NPROC, which is why we never run programs as root); a wrapper
  shell is PID 1 of the namespace, so when the program exits or is killed every process it
  started dies with it.
* ``userns`` (not root, unprivileged user namespaces allowed): the same namespaces inside a user
  namespace; the program keeps the caller's uid outside, so RLIMIT_NPROC is set to the caller's
  current process count plus ``max_procs``, and files the caller can write stay writable.
* ``none`` (no `unshare`, or namespaces refused): only rlimits, a scrubbed environment, its own
  working directory and a process-group kill. **There is no network isolation**, so by default
  (``require_isolation: true``) the sandbox refuses to start; set it to false to run anyway (a
  warning is logged once).

Always: a scrubbed environment (nothing from the parent, so no WANDB_API_KEY or tokens), its own
temporary working directory (removed afterwards), RLIMIT_CPU / AS / FSIZE / NOFILE / CORE,
PR_SET_PDEATHSIG so the tree dies with the caller, and a wall-clock timeout that SIGKILLs the whole
process group (and, in the namespace modes, the whole PID namespace).
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from megatron_rl.rewards.config import SandboxConfig

log = logging.getLogger(__name__)

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_INNER_WORKDIR = "/tmp/work"
_NS_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
             "--mount-proc"]
_warned_unisolated = False


class SandboxUnavailable(RuntimeError):
    """Isolation was required but this machine cannot provide it."""


@dataclass
class SandboxResult:
    returncode: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _probe(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@lru_cache(maxsize=1)
def isolation_mode() -> str:
    """``root_ns``, ``userns`` or ``none`` (see the module doc); probed once per process."""
    unshare = shutil.which("unshare", path=_SAFE_PATH)
    if unshare is None:
        return "none"
    if os.geteuid() == 0 and shutil.which("setpriv", path=_SAFE_PATH):
        if _probe([unshare, *_NS_FLAGS, "--", "true"]):
            return "root_ns"
    if _probe([unshare, "--user", "--map-root-user", *_NS_FLAGS, "--", "true"]):
        return "userns"
    return "none"


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    out.append(int(pid))
            except OSError:
                pass
    return out


def _threads_of_uid(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) of all processes owned by ``uid``."""
    n = 0
    for pid in _pids_of_uid(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


class Sandbox:
    def __init__(self, cfg: SandboxConfig | None = None):
        global _warned_unisolated
        self.cfg = cfg or SandboxConfig()
        self.cfg.validate()
        self.mode = isolation_mode()
        if self.mode == "none":
            if self.cfg.require_isolation:
                raise SandboxUnavailable(
                    "no network/PID namespace available (need `unshare` and root or unprivileged "
                    "user namespaces); set sandbox.require_isolation: false to run code without "
                    "network isolation")
            if not _warned_unisolated:
                log.warning("sandbox: namespaces unavailable; programs run WITHOUT network "
                            "isolation (rlimits, scrubbed env and process-group kill only)")
                _warned_unisolated = True
        self.python = self.cfg.python or shutil.which("python3", path=_SAFE_PATH) or "python3"

    # -- building the command ---------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {"PATH": _SAFE_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
                "PYTHONHASHSEED": "0"}

    def _command(self, argv: list[str], workdir: str, uid: int | None) -> list[str]:
        if self.mode == "none":
            return argv
        size = f"size={self.cfg.disk_mb}m"
        mounts = " ".join(f"if [ -d {d} ]; then mount -t tmpfs -o {size},mode=1777,nosuid,nodev "
                          f"tmpfs {d}; fi;" for d in _WORLD_WRITABLE)
        owner = uid if uid is not None else 0  # 0 inside a user namespace is the caller
        # cd first: the input files stay reachable as "." after /tmp is covered; they are copied
        # into a size-bounded tmpfs at /tmp/work owned by the program's uid, so whatever it
        # writes stays in RAM-backed, bounded space and vanishes with the namespace. The shell
        # stays PID 1 and waits, so a program killed by signal N exits as 128 + N (unshare
        # cannot re-raise every signal on itself).
        script = (f"set -e; cd {shlex.quote(workdir)}; {mounts} mkdir -p {_INNER_WORKDIR}; "
                  f"mount -t tmpfs -o {size},mode=0700,uid={owner},gid={owner},nosuid,nodev tmpfs "
                  f"{_INNER_WORKDIR}; cp -R ./. {_INNER_WORKDIR}/; cd {_INNER_WORKDIR}; set +e; "
                  "\"$@\"; rc=$?; exit $rc")
        inner = list(argv)
        if self.mode == "root_ns":
            inner = [shutil.which("setpriv", path=_SAFE_PATH), f"--reuid={uid}", f"--regid={uid}",
                     "--clear-groups", "--no-new-privs", "--", *argv]
            prefix = [shutil.which("unshare", path=_SAFE_PATH), *_NS_FLAGS]
        else:
            prefix = [shutil.which("unshare", path=_SAFE_PATH), "--user", "--map-root-user",
                      *_NS_FLAGS]
        return [*prefix, "--", "/bin/sh", "-c", script, "sandbox", *inner]

    def _preexec(self, nproc: int):
        cfg = self.cfg

        def limits() -> None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            mem = cfg.memory_mb * 1024 * 1024
            fsize = cfg.file_size_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_CPU, (cfg.cpu_s, cfg.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

        return limits

    # -- running ----------------------------------------------------------------------------------
    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: str | bytes = b"",
            timeout_s: float | None = None) -> SandboxResult:
        """Write ``files`` into a fresh directory and run ``argv`` there (paths relative to it)."""
        timeout_s = timeout_s or self.cfg.timeout_s
        uid = None
        if self.mode == "root_ns":
            uid = self.cfg.uid_base + random.SystemRandom().randrange(self.cfg.uid_span)
            nproc = self.cfg.max_procs
        elif os.geteuid() != 0:  # RLIMIT_NPROC counts all our threads: allow max_procs more
            nproc = _threads_of_uid(os.getuid()) + self.cfg.max_procs
        else:  # "none" as root: RLIMIT_NPROC does not bind root at all
            nproc = self.cfg.max_procs
        root = self.cfg.work_root or None
        base = tempfile.mkdtemp(prefix="mrl-sandbox-", dir=root)  # 0700, owned by us
        try:
            workdir = os.path.join(base, "work")
            os.mkdir(workdir, 0o700)
            for name, content in files.items():
                path = os.path.normpath(os.path.join(workdir, name))
                if not path.startswith(workdir + os.sep):
                    raise ValueError(f"sandbox file name escapes the work dir: {name!r}")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
            stdin_b = stdin.encode() if isinstance(stdin, str) else stdin
            with open(os.path.join(base, "stdin"), "wb") as f:
                f.write(stdin_b)
            return self._launch(argv, base, workdir, uid, nproc, timeout_s)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _launch(self, argv, base, workdir, uid, nproc, timeout_s) -> SandboxResult:
        out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        cmd = self._command(argv, workdir, uid)
        t0 = time.monotonic()
        timed_out = False
        with open(os.path.join(base, "stdin"), "rb") as fin, open(out_path, "wb") as fout, \
                open(err_path, "wb") as ferr:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, env=self._env(),
                                    cwd=workdir, start_new_session=True,
                                    preexec_fn=self._preexec(nproc), close_fds=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill_group(proc.pid)
                rc = proc.wait()
            # A program may leave children behind in its group (mode "none"); kill them too.
            self._kill_group(proc.pid)
        if uid is not None:
            self._reap_uid(uid)
        if self.mode != "none" and not timed_out and rc is not None and 128 < rc < 128 + 65:
            rc = -(rc - 128)  # the shell's "killed by signal" status, as subprocess reports it
        wall = time.monotonic() - t0
        return SandboxResult(rc, self._read(out_path), self._read(err_path), timed_out, wall)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _reap_uid(uid: int, wait_s: float = 5.0) -> None:
        """Wait until no process runs as the run's private uid; SIGKILL stragglers."""
        deadline = time.monotonic() + wait_s
        while True:
            pids = _pids_of_uid(uid)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                log.error("sandbox: %d processes of uid %d survive", len(pids), uid)
                return
            time.sleep(0.01)

    def _read(self, path: str) -> str:
        with open(path, "rb") as f:
            return f.read(self.cfg.max_output_bytes).decode("utf-8", errors="replace")

    def run_python(self, source: str, stdin: str | bytes = b"", timeout_s: float | None = None,
                   extra_files: dict[str, str] | None = None) -> SandboxResult:
        """Run ``source`` as ``main.py`` with the sandbox's interpreter (isolated mode, ``-I``)."""
        files = dict(extra_files or {})
        files["main.py"] = source
        return self.run(files, [self.python, "-I", "-B", "main.py"], stdin=stdin,
                        timeout_s=timeout_s)
