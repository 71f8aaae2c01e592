"""Hostile programs in the sandbox: each is contained and leaves the machine as it was.

Limits are kept tiny (8 processes, 256 MiB, 1-3 s) because this machine is shared.
"""

from __future__ import annotations

import os
import socket
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from megatron_rl.rewards.config import SandboxConfig
from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailable, isolation_mode

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(isolation_mode() == "none", reason="no namespaces on this machine"),
]

SECRET = "sk-test-" + uuid.uuid4().hex


def _cfg(**kw) -> SandboxConfig:
    base = dict(timeout_s=10.0, cpu_s=5, memory_mb=256, max_procs=8, file_size_mb=4)
    base.update(kw)
    return SandboxConfig(**base)


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (uid, cmdline) of every process on the machine."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out[int(pid)] = (uid, cmd)
    return out


def _sandbox_uids_alive(cfg: SandboxConfig) -> list[int]:
    return [pid for pid, (uid, _) in _procs().items()
            if cfg.uid_base <= uid < cfg.uid_base + cfg.uid_span]


@pytest.fixture
def sandbox():
    cfg = _cfg()
    yield Sandbox(cfg)
    assert _sandbox_uids_alive(cfg) == []  # nothing a program started outlives its run


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


def test_writes_outside_its_directory_do_not_land(sandbox):
    tag = uuid.uuid4().hex
    here = Path(__file__).parent  # a root-owned directory outside any temp dir
    targets = [here / f"pwned-{tag}", Path("/tmp") / f"pwned-{tag}", Path("/var/tmp") / f"pwned-{tag}",
               Path("/dev/shm") / f"pwned-{tag}", Path.home() / f"pwned-{tag}"]
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
        if sandbox.mode == "root_ns":
            # the repo directory and /root are not writable for the private uid
            assert f"refused {targets[0]}" in res.stdout and f"refused {targets[4]}" in res.stdout
        assert [t for t in targets if t.exists()] == []  # /tmp & co. were private tmpfs copies
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


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


def test_fork_bomb_is_contained():
    cfg = _cfg(timeout_s=2.0, max_procs=8)
    sandbox = Sandbox(cfg)
    before = len(_procs())
    t0 = time.monotonic()
    res = sandbox.run_python(textwrap.dedent("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """))
    wall = time.monotonic() - t0
    assert res.timed_out and wall < 2.0 + 10.0
    assert _sandbox_uids_alive(cfg) == []
    assert len(_procs()) <= before + 5  # other engineers' processes come and go; no bomb residue


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
    t0 = time.monotonic()
    res = sandbox.run_python("while True:\n    pass\n", timeout_s=1.0)
    assert res.timed_out and res.returncode is not None and res.returncode < 0
    assert time.monotonic() - t0 < 1.0 + 5.0


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

    monkeypatch.setattr(sb, "isolation_mode", lambda: "none")
    with pytest.raises(SandboxUnavailable, match="require_isolation"):
        sb.Sandbox(_cfg())
    assert sb.Sandbox(_cfg(require_isolation=False)).mode == "none"


def test_userns_mode_command_path(monkeypatch):
    """The non-root path (user namespace) runs programs cut off from the network; exercised here
    as root by forcing the mode (the uid mapping is the caller's, so only the namespaces count)."""
    import megatron_rl.rewards.sandbox as sb

    if not sb._probe(["unshare", "--user", "--map-root-user", *sb._NS_FLAGS, "--", "true"]):
        pytest.skip("unprivileged user namespaces refused here")
    monkeypatch.setattr(sb, "isolation_mode", lambda: "userns")
    res = sb.Sandbox(_cfg()).run_python(textwrap.dedent("""
        import os, socket
        print(os.getpid())
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=1)
        except OSError:
            print("blocked")
        """))
    pid, verdict = res.stdout.split()
    assert res.returncode == 0 and int(pid) < 100 and verdict == "blocked"  # own PID namespace (host pids run to 32768)
