"""The task's reward function: how close the model's number is to the answer.

A reward function is any function ``fn(response, ground_truth, extra_info)``:

* ``response``: the text to score (for a multi-turn prompt, the model's final turn);
* ``ground_truth``: the row's ``reward_model.ground_truth``;
* ``extra_info``: the row's ``extra_info`` (a copy);

returning a float, or a dict with ``score`` (required), ``correct`` (counted in ``reward/correct``;
default ``score >= 1``) and ``extracted`` (shown in the rollout dumps). It runs in a separate worker
process with a hard timeout; if it raises, hangs or returns something that is not a finite number,
the response scores a counted zero and the run goes on.
"""

import re

_NUMBER = re.compile(r"\d+")


def closeness(response, ground_truth, extra_info):
    match = _NUMBER.search(response)
    if match is None:
        return {"score": 0.0, "correct": False}
    guess, target = int(match.group()), int(ground_truth)
    scale = float(extra_info["scale"])  # the row's own tolerance
    return {"score": max(0.0, 1.0 - abs(guess - target) / scale), "correct": guess == target,
            "extracted": str(guess)}
