"""A trainer-like owner of vLLM servers, for tests/integration/rollout/test_fleet.py: what a
colocated trainer does with the servers it starts (an EngineLauncher: started together, registered,
restarted from its background supervisor thread when one exits), in a process of its own, so a test
can kill it with SIGKILL and check that its servers die with it.

Usage: python fleet_owner.py SPECS.pkl REGISTRY_DIR. Prints "ready" once every server answers; stops
them on SIGTERM or when its stdin closes (the test process ended, however).
"""

from __future__ import annotations

import pickle
import signal
import sys
import threading

from megatron_rl.rollout.launcher import EngineLauncher
from megatron_rl.rollout.registry import EngineRegistry


def main(specs_file: str, registry_dir: str) -> None:
    with open(specs_file, "rb") as f:
        specs = pickle.load(f)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    launcher = EngineLauncher(specs, registry=EngineRegistry(registry_dir), start_timeout_s=300.0)
    try:
        launcher.start()
        launcher.supervise_in_background()
        print("ready", flush=True)
        stop.wait()
    finally:
        launcher.stop()


if __name__ == "__main__":
    main(*sys.argv[1:3])
