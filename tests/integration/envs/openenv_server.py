"""The example's OpenEnv environment (examples/custom_task/service/guess_server.py) served by OpenEnv's
own server (``create_app`` + uvicorn), with what the service tests need to see and to break it:

* every answered step is appended to ``MRL_TEST_LOG`` (the server's own record of what it answered);
* the ``MRL_TEST_KILL_AT``-th step message kills the server process (SIGKILL, mid-step: its
  sessions' connections drop, new ones are refused);
* a message containing "slow" sleeps ``MRL_TEST_SLOW_S`` seconds before it is answered.

    python openenv_server.py PORT
"""

import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_task" / "service" / "guess_server.py"
_spec = importlib.util.spec_from_file_location("guess_server", EXAMPLE)
guess = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guess)

_LOCK = threading.Lock()
_STEPS = [0]


class TestedGuess(guess.GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        if "slow" in action.message:
            time.sleep(float(os.environ.get("MRL_TEST_SLOW_S", "5")))
        with _LOCK:
            _STEPS[0] += 1
            if _STEPS[0] == int(os.environ.get("MRL_TEST_KILL_AT", "0")):
                os.kill(os.getpid(), signal.SIGKILL)
            obs = super().step(action, timeout_s, **kwargs)
            with open(os.environ.get("MRL_TEST_LOG", os.devnull), "a") as f:
                f.write(f"{action.message!r} -> {obs.hint}\n")
        return obs


if __name__ == "__main__":
    import uvicorn
    from openenv.core.env_server import create_app

    app = create_app(TestedGuess, guess.GuessAction, guess.GuessObservation, max_concurrent_envs=256)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
