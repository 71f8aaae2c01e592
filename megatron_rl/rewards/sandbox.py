"""Run untrusted programs (model-written code) contained.

The view and the namespaces come from bubblewrap (``bwrap``, Debian/Ubuntu package
``bubblewrap``); the limits bwrap does not set are ours. ``Sandbox.mode`` says which is active:

* ``bwrap``: the program sees only

  - the interpreter and its libraries, read-only: ``/usr`` (with the ``/bin``, ``/lib*`` links of a
    merged-usr system) and, for an interpreter outside ``/usr`` (a virtualenv, pyenv), its
    prefixes and ``sys.path`` entries;
  - its own working directory ``/tmp/work`` holding the files it was given, inside a private
    ``/tmp`` tmpfs of ``disk_mb``, and a private ``/dev/shm`` of ``disk_mb``: the only writable
    places; every other path, ``/`` included, is read-only or absent (no host ``/tmp``, ``/etc``,
    home directories, run directories or data, no ``/sys``, no world-writable host directory);
  - a minimal ``/dev`` (null, zero, full, random, urandom, tty) and its own ``/proc``.

  New user, PID, network (no interfaces but an unconfigured loopback), IPC, UTS and cgroup
  namespaces; no nested user namespaces (bwrap >= 0.8); a new session (no terminal injection).
  When the trainer runs as root, the program runs as a private uid drawn per run (bwrap itself
  starts unprivileged under it), so RLIMIT_NPROC counts only that run's processes (root ignores
  RLIMIT_NPROC) and every straggler can be found and killed by uid.
* ``none`` (bwrap missing, or unable to create its namespaces here): by default
  (``require_isolation: true``) the sandbox refuses to start, naming the reason and how to install
  bubblewrap. ``require_isolation: false`` is the explicit opt-in to run programs with only the
  limits below, a scrubbed environment and their own working directory, **without file-system or
  network isolation** (a warning is logged once).

Always, in both modes: a scrubbed environment (nothing from the parent, so no WANDB_API_KEY or
tokens), RLIMIT_CPU / AS / FSIZE / NOFILE / CORE / NPROC, PR_SET_PDEATHSIG so the tree dies with the
caller, and a wall-clock timeout that SIGKILLs the whole process group (and with bwrap the whole PID
namespace: when its init exits every process in it dies).

A caller that must tell "the program ran to a point" from "the program ended early" passes a
``secret``: the program receives it on an inherited pipe (``MRL_SECRET_FD``) and may write to a
result file (``MRL_RESULT_FD``) that the caller reads back (``SandboxResult.channel``); see
``rewards/harness.py``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import resource
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
_PR_SET_NO_NEW_PRIVS = 38
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Where the program runs inside the bwrap view (a private tmpfs /tmp holds it).
INNER_WORKDIR = "/tmp/work"
#: Processes bwrap itself keeps under the program's uid (its monitor and the namespace's init).
_BWRAP_PROCS = 2
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`, Fedora/RHEL: "
                "`dnf install bubblewrap`)")
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
    # What the program wrote to MRL_RESULT_FD (only when run with a secret).
    channel: bytes = b""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _bwrap() -> str | None:
    return shutil.which("bwrap", path=_SAFE_PATH)


def _private_uid(cfg: SandboxConfig) -> int | None:
    """A uid for one run when we are root (None otherwise: programs run as the caller)."""
    if os.geteuid() != 0:
        return None
    return cfg.uid_base + random.SystemRandom().randrange(cfg.uid_span)


@lru_cache(maxsize=None)
def _bwrap_features(bwrap: str) -> frozenset[str]:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(opt for opt in ("--disable-userns", "--size") if opt in out.stdout + out.stderr)


@lru_cache(maxsize=None)
def _interpreter_roots(python: str) -> tuple[str, ...]:
    """Directories outside /usr that ``python`` needs (a venv's or pyenv's prefix, sys.path)."""
    code = ("import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
            "sys.base_exec_prefix, *sys.path]))")
    try:
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                             env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8"})
        paths = json.loads(out.stdout) if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError):
        paths = []
    paths.append(os.path.dirname(os.path.abspath(python)))
    paths.append(os.path.dirname(os.path.realpath(python)))
    roots: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths if p} | {os.path.abspath(p) for p in paths if p}):
        if not os.path.isdir(p) or p == "/" or p == "/usr" or p.startswith("/usr/"):
            continue
        if any(p == r or p.startswith(r + os.sep) for r in roots):
            continue
        roots.append(p)
    return tuple(roots)


def _system_links() -> list[str]:
    """``/bin``, ``/lib*``, ``/sbin`` as on the host: symlinks into /usr, or read-only binds."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_view(python: str, disk_mb: int, bwrap: str) -> list[str]:
    """bwrap options of the program's view (everything but the files and the command)."""
    feats = _bwrap_features(bwrap)
    size = ["--size", str(disk_mb << 20)] if "--size" in feats else []
    args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr", *_system_links()]
    for root in _interpreter_roots(python):
        args += ["--ro-bind", root, root]
    args += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             *size, "--tmpfs", "/tmp", "--dir", INNER_WORKDIR]
    if "--disable-userns" in feats:
        args.append("--disable-userns")
    return args


def _probe_bwrap(python: str, cfg: SandboxConfig) -> str:
    """'' when a program runs under bwrap here, else why not (one line)."""
    bwrap = _bwrap()
    if bwrap is None:
        return f"bwrap not found on {_SAFE_PATH}"
    uid = _private_uid(cfg)
    argv = [bwrap, *bwrap_view(python, cfg.disk_mb, bwrap), "--remount-ro", "/", "--chdir",
            INNER_WORKDIR, python, "-I", "-c", "pass"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                             env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8"},
                             user=uid, group=uid, extra_groups=[] if uid is not None else None)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap failed to start: {exc}"
    if out.returncode != 0:
        err = " ".join(out.stderr.split())[-300:]
        return (f"bwrap cannot run {python} here (rc {out.returncode}: {err}); it needs unprivileged "
                "user namespaces (user.max_user_namespaces > 0; on Ubuntu also "
                "kernel.apparmor_restrict_unprivileged_userns=0) and an interpreter readable by "
                "other users")
    return ""


@lru_cache(maxsize=None)
def _isolation(python: str, cfg_key: tuple) -> tuple[str, str]:
    cfg = SandboxConfig(uid_base=cfg_key[0], uid_span=cfg_key[1], disk_mb=cfg_key[2])
    why = _probe_bwrap(python, cfg)
    return ("none", why) if why else ("bwrap", "")


def _default_python(cfg: SandboxConfig) -> str:
    return cfg.python or shutil.which("python3", path=_SAFE_PATH) or "python3"


def isolation_mode(cfg: SandboxConfig | None = None) -> str:
    """``bwrap`` or ``none`` (see the module doc); probed once per interpreter and process."""
    cfg = cfg or SandboxConfig()
    return _isolation(_default_python(cfg), (cfg.uid_base, cfg.uid_span, cfg.disk_mb))[0]


def isolation_problem(cfg: SandboxConfig | None = None) -> str:
    """Why ``isolation_mode`` is ``none`` ('' when bwrap works)."""
    cfg = cfg or SandboxConfig()
    return _isolation(_default_python(cfg), (cfg.uid_base, cfg.uid_span, cfg.disk_mb))[1]


def _pids_of_uid(uid: int, live_only: bool = False) -> list[int]:
    """Processes owned by ``uid``; ``live_only`` skips zombies (dead, waiting to be reaped)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid != uid:
                    continue
                if live_only:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                            continue
                out.append(int(pid))
            except (OSError, IndexError):
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
        self.python = _default_python(self.cfg)
        self.mode = isolation_mode(self.cfg)
        if self.mode == "none":
            if self.cfg.require_isolation:
                raise SandboxUnavailable(
                    f"code rewards need the bubblewrap sandbox: {isolation_problem(self.cfg)}. "
                    f"To fix: {INSTALL_HINT}. Or set reward.code.sandbox.require_isolation: false "
                    "to run model-written programs with rlimits only, WITHOUT file-system or network "
                    "isolation")
            if not _warned_unisolated:
                log.warning("sandbox: %s; require_isolation is false, so programs run WITHOUT "
                            "file-system or network isolation (rlimits, scrubbed env and "
                            "process-group kill only)", isolation_problem(self.cfg))
                _warned_unisolated = True
        self._bwrap = _bwrap() if self.mode == "bwrap" else None

    # -- building the command ---------------------------------------------------------------------
    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return {"PATH": _SAFE_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
                "PYTHONHASHSEED": "0", **extra}

    def _command(self, argv: list[str], file_fds: dict[str, int]) -> list[str]:
        if self.mode == "none":
            return argv
        args = [self._bwrap, *bwrap_view(self.python, self.cfg.disk_mb, self._bwrap)]
        made = {INNER_WORKDIR}
        for name, fd in sorted(file_fds.items()):
            dest = f"{INNER_WORKDIR}/{name}"
            parts = name.split("/")[:-1]
            for i in range(len(parts)):
                d = "/".join([INNER_WORKDIR, *parts[:i + 1]])
                if d not in made:
                    args += ["--dir", d]
                    made.add(d)
            args += ["--file", str(fd), dest]
        return [*args, "--remount-ro", "/", "--chdir", INNER_WORKDIR, "--", *argv]

    def _preexec(self, nproc: int):
        cfg = self.cfg

        def limits() -> None:  # runs after the uid switch, so PDEATHSIG is not cleared by it
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
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
            timeout_s: float | None = None, secret: bytes | None = None) -> SandboxResult:
        """Put ``files`` into a fresh working directory and run ``argv`` there (paths relative to it).

        With ``secret``: the program can read it once from the pipe ``$MRL_SECRET_FD`` and write
        to ``$MRL_RESULT_FD``; what it wrote comes back as ``SandboxResult.channel``.
        """
        timeout_s = timeout_s or self.cfg.timeout_s
        bw = _BWRAP_PROCS if self.mode == "bwrap" else 0
        uid = _private_uid(self.cfg) if self.mode == "bwrap" else None
        if uid is not None:
            nproc = self.cfg.max_procs + bw
        elif os.geteuid() != 0:  # RLIMIT_NPROC counts all our threads: allow max_procs more
            nproc = _threads_of_uid(os.getuid()) + self.cfg.max_procs + bw
        else:  # "none" as root: RLIMIT_NPROC does not bind root at all
            nproc = self.cfg.max_procs
        root = self.cfg.work_root or None
        base = tempfile.mkdtemp(prefix="mrl-sandbox-", dir=root)  # 0700, owned by us
        opened: list[int] = []
        try:
            workdir = os.path.join(base, "work")
            os.mkdir(workdir, 0o700)
            file_fds: dict[str, int] = {}
            for name, content in files.items():
                path = os.path.normpath(os.path.join(workdir, name))
                if not path.startswith(workdir + os.sep):
                    raise ValueError(f"sandbox file name escapes the work dir: {name!r}")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
                if self.mode == "bwrap":  # bwrap copies it into the program's tmpfs
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    opened.append(fd)
                    file_fds[os.path.relpath(path, workdir)] = fd
            stdin_b = stdin.encode() if isinstance(stdin, str) else stdin
            with open(os.path.join(base, "stdin"), "wb") as f:
                f.write(stdin_b)
            env: dict[str, str] = {}
            result_path = os.path.join(base, "result")
            if secret is not None:
                r, w = os.pipe()
                opened.append(r)
                try:
                    os.write(w, secret)  # a few bytes: fits the pipe buffer
                finally:
                    os.close(w)
                res_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                                 0o600)
                opened.append(res_fd)
                env = {"MRL_SECRET_FD": str(r), "MRL_RESULT_FD": str(res_fd)}
                if self.mode == "bwrap":  # the program's processes are alone in their PID namespace
                    env["MRL_OWN_PID_NAMESPACE"] = "1"
            cmd = self._command(argv, file_fds)
            res = self._launch(cmd, base, workdir, uid, nproc, timeout_s, env, tuple(opened))
            if secret is not None:
                with open(result_path, "rb") as f:
                    res.channel = f.read(self.cfg.max_output_bytes)
            return res
        finally:
            for fd in opened:
                os.close(fd)
            shutil.rmtree(base, ignore_errors=True)

    def _launch(self, cmd, base, workdir, uid, nproc, timeout_s, env, pass_fds) -> SandboxResult:
        out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        t0 = time.monotonic()
        timed_out = False
        with open(os.path.join(base, "stdin"), "rb") as fin, open(out_path, "wb") as fout, \
                open(err_path, "wb") as ferr:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, env=self._env(env),
                                    cwd=workdir if self.mode == "none" else "/",
                                    start_new_session=True, close_fds=True,
                                    pass_fds=pass_fds, preexec_fn=self._preexec(nproc), user=uid,
                                    group=uid, extra_groups=[] if uid is not None else None)
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
        if self.mode == "bwrap" and not timed_out and rc is not None and 128 < rc < 128 + 65:
            rc = -(rc - 128)  # bwrap reports "killed by signal N" as 128 + N
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
        """Wait until no process runs as the run's private uid; SIGKILL stragglers.

        Zombies do not count: bwrap's namespace init, killed when bwrap exits, waits there for the
        host's init to reap it.
        """
        deadline = time.monotonic() + wait_s
        while True:
            pids = _pids_of_uid(uid, live_only=True)
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
                   extra_files: dict[str, str] | None = None, secret: bytes | None = None,
                   args: list[str] | None = None) -> SandboxResult:
        """Run ``source`` as ``main.py`` with the sandbox's interpreter (isolated mode, ``-I``)."""
        files = dict(extra_files or {})
        files["main.py"] = source
        return self.run(files, [self.python, "-I", "-B", "main.py", *(args or [])], stdin=stdin,
                        timeout_s=timeout_s, secret=secret)
