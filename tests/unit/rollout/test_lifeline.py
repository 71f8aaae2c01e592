"""The lifeline of launched servers (megatron_rl.rollout.lifeline), on plain processes: a stand-in
server (a module that starts a helper in its process group, as vLLM's API server starts EngineCore)
started in its own session by an owner from a thread that then exits (what the launcher's supervisor
does when it restarts a server), then the owner killed with SIGKILL. The real vLLM servers' case is
tests/integration/rollout/test_fleet.py (its last test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.procs import live_in_group, wait_groups_gone

SERVER = textwrap.dedent("""
    import subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # same group
    print(helper.pid, flush=True)
    time.sleep(300)
""")

OWNER = textwrap.dedent("""
    import os, subprocess, sys, threading
    from megatron_rl.rollout.lifeline import owned

    procs = []
    def start():  # from a thread that exits right after: PR_SET_PDEATHSIG would fire here
        procs.append(subprocess.Popen(owned([sys.executable, "-m", "fake_server"], os.getpid()),
                                      start_new_session=True, stdout=subprocess.PIPE, text=True))
    t = threading.Thread(target=start)
    t.start()
    t.join()
    print(procs[0].pid, procs[0].stdout.readline().strip(), flush=True)
    threading.Event().wait(300)
""")


def test_a_server_dies_with_its_owner_killed_by_sigkill_not_with_the_thread_that_started_it(tmp_path):
    (tmp_path / "fake_server.py").write_text(SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    server = helper = None
    try:
        server, helper = (int(x) for x in owner.stdout.readline().split())
        assert os.getpgid(server) == server and os.getpgid(helper) == server  # its own group, helper in it
        time.sleep(1.5)  # several watchdog rounds after the starting thread exited
        assert sorted(live_in_group(server)) == sorted([server, helper]), "it died with the starting thread"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        waited, alive = wait_groups_gone([server], timeout_s=10)
        assert not alive, f"still alive {waited:.1f} s after the owner was killed: {alive}"
        assert waited < 3, waited
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if server is not None and live_in_group(server):
            os.killpg(server, signal.SIGKILL)
