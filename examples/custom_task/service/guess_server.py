"""The same task as an OpenEnv environment server (``pip install openenv-core``): the environment runs
as its own service, in its own process (or machine, or container), and the trainer drives it over
OpenEnv's protocol (``envs.services`` in service.yaml).

    python guess_server.py --port 8011

An OpenEnv environment defines its Action and Observation (pydantic models) and ``reset`` / ``step``;
``create_app`` (OpenEnv's) serves it: a WebSocket session per episode at /ws, /health, /schema.
Here: the model's turn is the action's ``message``; the observation's ``hint`` is ">" (the answer is
more), "<" (less) or "=" (right); the episode ends when the guess is right or at the second turn, with
the reward closeness (the trainer scores the final turn with the data's reward function).
"""

import argparse
import re

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State

_NUMBER = re.compile(r"\d+")


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    hint: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: no shared state

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, target=0, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = int(target)  # the row's extra_info.env_kwargs.target
        return GuessObservation(hint="")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        match = _NUMBER.search(action.message)
        guess = int(match.group()) if match else None
        right = guess == self.target
        hint = "=" if right else ">" if guess is not None and guess < self.target else "<"
        done = right or self._state.step_count >= 2
        reward = 0.0 if guess is None else max(0.0, 1.0 - abs(guess - self.target) / 20)
        return GuessObservation(hint=hint, done=done, reward=reward)

    @property
    def state(self):
        return self._state


def main():
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()
    app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
