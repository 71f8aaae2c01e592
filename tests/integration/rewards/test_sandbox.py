"""Hostile programs in the sandbox: each is contained and leaves the machine as it was.

The program sees only its own directory and the interpreter (bubblewrap): host files (the trainer's
run directory with the training data, /etc, home directories, the host's /tmp) are invisible and
nothing lands outside its private tmpfs, not even in a world-writable directory. Limits are kept
tiny (8 processes, 256 MiB, 1-3 s) because this machine is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from megatron_rl.rewards.config import SandboxConfig
from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailable
from tests.integration.rewards.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("bwrap_sandbox")]

SECRET = "sk-test-" + uuid.uuid4().hex


def _cfg(**kw) -> SandboxConfig:
    base = dict(timeout_s=10.0, cpu_s=5, memory_mb=256, max_procs=8, file_size_mb=4)
    base.update(kw)
    return SandboxConfig(**base)


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (uid, cmdline) of every live process on the machine (zombies are dead already)."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
                state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                out[int(pid)] = (uid, cmd)
    return out


def _alive_as(uids: list[int]) -> list[int]:
    """Live processes running as one of ``uids``."""
    return [pid for pid, (uid, _) in _procs().items() if uid in set(uids)]


@pytest.fixture
def own_uids(monkeypatch) -> list[int]:
    """The private uids this test's runs were given. Only their processes must be gone after a run:
    the rest of the sandbox's uid range belongs to other runs on this shared machine (another
    engineer's reward tests: each live run is 3 processes, bwrap, its namespace init and the program)."""
    import megatron_rl.rewards.sandbox as sb

    drawn, draw = [], sb._private_uid

    def recording(cfg):
        uid = draw(cfg)
        if uid is not None:
            drawn.append(uid)
        return uid

    monkeypatch.setattr(sb, "_private_uid", recording)
    return drawn


@pytest.fixture
def sandbox(own_uids):
    yield Sandbox(_cfg())
    assert _alive_as(own_uids) == []  # nothing a program started outlives its run


def _startup_s(sandbox: Sandbox) -> float:
    """The wall time of an empty program now: what starting and reaping one costs on this shared
    machine at its current load (a wall-clock bound below allows a few of these on top)."""
    res = sandbox.run_python("pass")
    assert res.ok, res.stderr
    return res.wall_s


@pytest.fixture
def host_dir():
    """A directory any user can enter, outside every temp dir (/run when root, else a tmp dir)."""
    parent = "/run" if os.geteuid() == 0 and os.access("/run", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="mrl-sandbox-test-", dir=parent))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ordinary_program_runs(sandbox):
    res = sandbox.run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"
                             "open('out.txt', 'w').write('fine')\n", stdin="1 2 3\n")
    assert res.ok and res.stdout.strip() == "6"


def test_env_secret_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    res = sandbox.run_python(textwrap.dedent(f"""
        import os
        print(dict(os.environ))
        for pid in ({os.getpid()}, {os.getppid()}, 1):
            try:
                print(open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as exc:
                print("denied", pid, exc)
        """))
    assert res.returncode == 0, res.stderr
    assert "PATH" in res.stdout  # it did print its environment
    assert SECRET not in res.stdout + res.stderr


def test_writes_outside_its_directory_do_not_land(sandbox, host_dir):
    tag = uuid.uuid4().hex
    scratch = host_dir / "scratch"  # a cluster's world-writable /scratch
    scratch.mkdir()
    scratch.chmod(0o1777)
    here = Path(__file__).parent  # the checkout
    targets = [here / f"pwned-{tag}", Path("/tmp") / f"pwned-{tag}", Path("/var/tmp") / f"pwned-{tag}",
               Path("/dev/shm") / f"pwned-{tag}", Path.home() / f"pwned-{tag}", scratch / f"pwned-{tag}",
               Path("/") / f"pwned-{tag}", Path("/usr") / f"pwned-{tag}", Path("/dev") / f"pwned-{tag}"]
    try:
        res = sandbox.run_python(textwrap.dedent(f"""
            for p in {[str(t) for t in targets]!r}:
                try:
                    open(p, "w").write("x")
                    print("wrote", p)
                except OSError as exc:
                    print("refused", p, type(exc).__name__)
            open("inside.txt", "w").write("ok")
            print("inside ok")
            """))
        assert res.returncode == 0, res.stderr
        assert "inside ok" in res.stdout
        # Only the private /tmp and /dev/shm take writes; everything else is read-only or absent.
        wrote = {line.split()[1] for line in res.stdout.splitlines() if line.startswith("wrote ")}
        assert wrote <= {str(targets[1]), str(targets[3])}, res.stdout
        assert [t for t in targets if t.exists()] == []  # and those were private tmpfs copies
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_host_files_are_invisible(sandbox, host_dir):
    """The trainer's run directory (training data with ground truths), /etc, homes, the host /tmp."""
    secret = "ground-truth-" + uuid.uuid4().hex
    run_dir = host_dir / "run"
    (run_dir / "data").mkdir(parents=True)
    for d in (run_dir, run_dir / "data"):
        d.chmod(0o755)
    train = run_dir / "data" / "train.jsonl"
    train.write_text(json.dumps({"reward_model": {"ground_truth": secret}}) + "\n")
    train.chmod(0o644)
    fd, name = tempfile.mkstemp(prefix="mrl-visible-", dir="/tmp")
    os.close(fd)
    host_tmp = Path(name)
    host_tmp.write_text(secret)
    host_tmp.chmod(0o644)
    paths = [str(train), str(run_dir), str(host_tmp), "/etc/passwd", "/etc/hostname", "/root", "/home",
             str(REPO / "README.md"), str(Path(__file__)), "/sys/kernel", "/var"]
    try:
        res = sandbox.run_python(textwrap.dedent(f"""
            import json, os
            print(json.dumps(sorted(os.listdir("/"))))
            for p in {paths!r}:
                try:
                    print("read", p, os.listdir(p) if os.path.isdir(p) else open(p).read()[:200])
                except OSError as exc:
                    print("hidden", p, type(exc).__name__)
            """))
    finally:
        host_tmp.unlink(missing_ok=True)
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout
    assert [line for line in res.stdout.splitlines() if line.startswith("read ")] == []
    root = json.loads(res.stdout.splitlines()[0])
    assert set(root) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "dev", "proc", "tmp"}, root


def test_network_is_unreachable(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connections = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                connections.append(conn)
            except (socket.timeout, OSError):
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        res = sandbox.run_python(textwrap.dedent(f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
                try:
                    socket.create_connection(addr, timeout=1).close()
                    print("connected", addr)
                except OSError as exc:
                    print("blocked", addr, type(exc).__name__)
            try:
                socket.getaddrinfo("pypi.org", 443)
                print("resolved")
            except OSError:
                print("no dns")
            """))
        time.sleep(0.3)  # a connection in flight would be accepted by now
        stop.set()
        t.join()
    finally:
        server.close()
    assert res.returncode == 0, res.stderr
    assert "connected" not in res.stdout and res.stdout.count("blocked") == 3
    assert "no dns" in res.stdout
    assert connections == []


def test_fork_bomb_is_contained(own_uids):
    cfg = _cfg(timeout_s=2.0, max_procs=8)
    sandbox = Sandbox(cfg)
    startup = _startup_s(sandbox)
    marker = f"bomb-{uuid.uuid4().hex}"  # every fork's command line carries it
    t0 = time.monotonic()
    res = sandbox.run_python(textwrap.dedent("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """), args=[marker])
    wall = time.monotonic() - t0
    assert res.timed_out and wall < 2.0 + 10.0 + 3 * startup
    assert _alive_as(own_uids) == []
    assert [cmd for _, cmd in _procs().values() if marker in cmd] == []  # no bomb residue, under any uid


def test_fork_count_is_capped(sandbox):
    res = sandbox.run_python(textwrap.dedent("""
        import os, time
        n = 0
        for _ in range(100):
            try:
                if os.fork() == 0:
                    time.sleep(20)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print(n)
        """), timeout_s=5)
    assert res.returncode == 0, res.stderr
    assert 1 <= int(res.stdout.strip()) < 8  # the cap (8) includes the program itself


def test_infinite_loop_is_killed(sandbox):
    startup = _startup_s(sandbox)
    t0 = time.monotonic()
    res = sandbox.run_python("while True:\n    pass\n", timeout_s=1.0)
    assert res.timed_out and res.returncode is not None and res.returncode < 0
    assert time.monotonic() - t0 < 1.0 + 5.0 + 3 * startup


def test_cpu_limit_stops_a_busy_program_before_the_wall_clock():
    import signal

    sandbox = Sandbox(_cfg(cpu_s=1, timeout_s=60.0))
    res = sandbox.run_python("while True:\n    pass\n")
    # killed by RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL at the hard one), not the timeout
    assert not res.timed_out
    assert res.returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU)


def test_memory_bomb_fails_inside(sandbox):
    res = sandbox.run_python(textwrap.dedent("""
        chunks = []
        while True:
            chunks.append(bytearray(32 << 20))
        """))
    assert not res.timed_out and res.returncode != 0
    assert "MemoryError" in res.stderr


def test_file_size_is_capped(sandbox):
    res = sandbox.run_python("open('big', 'wb').write(b'x' * (64 << 20))\n")
    assert res.returncode != 0 and "File too large" in res.stderr


def test_disk_fill_is_bounded():
    sandbox = Sandbox(_cfg(disk_mb=8, file_size_mb=4))
    res = sandbox.run_python(textwrap.dedent("""
        n = 0
        try:
            for i in range(1000):
                open(f"f{i}", "wb").write(b"x" * (1 << 20))
                n += 1
        except OSError as exc:
            print(n, exc.errno)
        """))
    written, errno = res.stdout.split()
    assert res.returncode == 0 and int(written) <= 8 and errno == "28"  # ENOSPC in its own tmpfs


def test_detached_children_die_with_the_program(sandbox):
    marker = f"{time.time_ns() % 10**6}.{os.getpid()}"
    res = sandbox.run_python(textwrap.dedent(f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        print("parent done")
        """))
    assert res.returncode == 0 and "parent done" in res.stdout
    time.sleep(0.2)
    assert [cmd for _, cmd in _procs().values() if marker in cmd] == []


def test_output_is_bounded(sandbox):
    res = sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)\n")
    assert res.returncode != 0 or res.timed_out
    assert len(res.stdout) <= sandbox.cfg.max_output_bytes


def test_isolation_required_but_unavailable(monkeypatch):
    import megatron_rl.rewards.sandbox as sb

    monkeypatch.setattr(sb, "isolation_mode", lambda cfg=None: "none")
    monkeypatch.setattr(sb, "isolation_problem", lambda cfg=None: "bwrap not found")
    with pytest.raises(SandboxUnavailable, match="require_isolation"):
        sb.Sandbox(_cfg())
    assert sb.Sandbox(_cfg(require_isolation=False)).mode == "none"


def test_missing_bwrap_is_refused_naming_the_install(monkeypatch, caplog):
    """Without bubblewrap: refused with how to install it; weaker only by explicit opt-in."""
    import megatron_rl.rewards.sandbox as sb

    monkeypatch.setattr(sb, "_bwrap", lambda: None)
    monkeypatch.setattr(sb, "_warned_unisolated", False)
    sb._isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as err:
            sb.Sandbox(_cfg())
        assert "bwrap not found" in str(err.value) and "apt-get install bubblewrap" in str(err.value)
        with caplog.at_level("WARNING"):
            weak = sb.Sandbox(_cfg(require_isolation=False))
        assert weak.mode == "none" and "WITHOUT file-system or network isolation" in caplog.text
        res = weak.run_python("print(6 * 7)")
        assert res.ok and res.stdout.strip() == "42"
    finally:
        sb._isolation.cache_clear()


# Run by a non-root trainer: a program that tries to read the trainer's own file and /etc, to write
# into the trainer's own directory and to reach the network.
_DRIVER = r'''
import json, os, sys
from megatron_rl.rewards.config import SandboxConfig
from megatron_rl.rewards.sandbox import Sandbox
own = sys.argv[1]
sb = Sandbox(SandboxConfig(timeout_s=10.0, memory_mb=256, max_procs=8))
prog = """
import os, socket, sys
print(os.getpid())
for p in sys.argv[1:3]:
    try:
        print("read", open(p).read())
    except OSError:
        print("hidden", p)
try:
    open(sys.argv[3], "w").write("x")
    print("wrote")
except OSError:
    print("refused")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
except OSError:
    print("blocked")
"""
res = sb.run_python(prog, args=[os.path.join(own, "mine.txt"), "/etc/passwd", os.path.join(own, "pwned.txt")])
print(json.dumps({"mode": sb.mode, "rc": res.returncode, "out": res.stdout, "err": res.stderr}))
'''


def test_non_root_caller_gets_the_same_view(host_dir):
    """A trainer that is not root: its own files are as invisible and unwritable as anything else."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to start a non-root trainer) and /usr/bin/python3")
    uid = 150_000 + os.getpid() % 10_000
    own = host_dir / "own"
    own.mkdir()
    (own / "mine.txt").write_text("private")
    for p in (own, own / "mine.txt"):
        os.chown(p, uid, uid)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "HOME": str(own)}
    proc = subprocess.run([python, "-c", _DRIVER, str(own)], capture_output=True, text=True, timeout=60,
                          env=env, user=uid, group=uid, extra_groups=[], cwd=str(own))
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"the checkout is not importable by another user: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["mode"] == "bwrap" and got["rc"] == 0, got
    pid, *lines = got["out"].split("\n")
    assert int(pid) < 10  # its own PID namespace
    assert [ln for ln in lines if ln.startswith(("read", "wrote"))] == [], got["out"]
    assert "blocked" in lines
    assert not (own / "pwned.txt").exists()
