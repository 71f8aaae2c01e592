"""A stand-in trainer for the node_launch.sh tests: checkpoints (writes a file) and exits 99 on USR1.

It starts a helper process with the spawn method, as Megatron's checkpoint writer and vLLM do; such
a helper has USR1 at its default action (terminate), so it survives only if nobody signals it. On
USR1 the worker records whether its helper is still alive, then exits 99 ("checkpointed").
Usage: stop_worker.py OUT_DIR [MAX_SECONDS]
"""

import multiprocessing as mp
import os
import signal
import sys
import time


def _helper():
    time.sleep(600)


def main() -> int:
    out_dir, limit = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    stop = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append(time.time()))
    helper = mp.get_context("spawn").Process(target=_helper, daemon=True)
    helper.start()
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out_dir, f"ready-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.time() + limit
    while time.time() < deadline:
        if stop:
            with open(os.path.join(out_dir, f"stopped-{rank}"), "w") as f:
                f.write("helper alive" if helper.is_alive() else "helper dead")
            helper.terminate()
            # Like the trainer's checkpoint barrier: no rank exits before every rank has stopped
            # (torchrun tears the other workers down as soon as one exits non-zero).
            world = int(os.environ.get("WORLD_SIZE", "1"))
            wait_until = time.time() + 60
            while time.time() < wait_until and not all(
                    os.path.exists(os.path.join(out_dir, f"stopped-{r}")) for r in range(world)):
                time.sleep(0.05)
            return 99
        time.sleep(0.1)
    helper.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
