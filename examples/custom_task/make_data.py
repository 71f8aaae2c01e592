"""Write data/train.jsonl and data/eval.jsonl: verl-format rows of small sums.

Each row names its reward style (``reward_model.style``: a key of ``reward.functions``) and its
environment (``extra_info.env``: a key of ``envs.classes``); ``extra_info.scale`` is read by the
reward function, ``extra_info.env_kwargs`` is sent to an OpenEnv server's reset (service/).
"""

import json
import random
from pathlib import Path


def rows(n, seed, split):
    rng = random.Random(f"{seed}-{split}")
    for i in range(n):
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        yield {"data_source": "custom/sums", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
               "reward_model": {"style": "closeness", "ground_truth": str(a + b)},
               "extra_info": {"split": split, "index": i, "env": "hint", "scale": 20,
                              "env_kwargs": {"target": a + b}}}


if __name__ == "__main__":
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for split, n in (("train", 256), ("eval", 32)):
        with (out / f"{split}.jsonl").open("w") as f:
            for row in rows(n, 0, split):
                f.write(json.dumps(row) + "\n")
