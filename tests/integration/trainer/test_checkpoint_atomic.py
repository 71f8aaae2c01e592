"""kill -9 at every moment of a save never leaves a directory that resume takes for complete.

One worker process (kill_save_worker.py) runs the end of a stage — a periodic save that prunes,
the final checkpoint with its HF export replacing an older one, the removal of the step
checkpoints — with the real single-rank Megatron policy. It records what a kill -9 would leave at
every file-system event of that operation (about a hundred: every directory made, renamed or
deleted, every file opened, first written and fsynced, in the trainer and in Megatron's forked
shard writers), and kills it for real (SIGKILL to its process group) at six of them. After each,
what a restart sees is checked here: every directory that counts as complete is intact and loads
into the policy (all of them written before any optimizer step), resume finds a checkpoint no
older than before the operation, the final checkpoint is the old or the new one whole, nothing
staged or half-deleted is left behind; the real kills leave what the recorded moments say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def kills(tmp_path_factory):
    from megatron_rl.demo import TinySpec, write_tiny_model

    work = tmp_path_factory.mktemp("kill_save")
    # small, so that a hundred copies of the run directory cost little
    model = write_tiny_model(work / "model", TinySpec(hidden_size=64, intermediate_size=128,
                                                      num_layers=1, num_heads=2, num_kv_heads=2,
                                                      seed=3))
    out = work / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "kill_save_worker.py"), str(model),
                           str(work / "runs"), str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def test_the_moments_cover_the_whole_operation(kills):
    moments = kills["moments"]
    kinds = {m["event"] for m in moments}
    assert {"mkdir", "open", "first_write", "fsync", "rename", "replace", "unlink", "rmtree",
            "torch.save", "end"} <= kinds, kinds
    assert len(moments) > 50, len(moments)
    assert len(kills["real_kills"]) == 6


def test_after_any_kill_everything_complete_is_intact_and_loads(kills):
    for r in kills["moments"] + kills["real_kills"]:
        for name, entry in r["complete"].items():
            where = f"kill point {r['k']}: {name}"
            assert entry["damage"] is None, f"{where}: {entry['damage']}"
            assert entry["loads"] is True, f"{where}: {entry['loads']}"
            if name.startswith("s1/checkpoints/step_"):
                assert entry["step"] == int(name.rsplit("_", 1)[1]), where
        assert not r["leftovers"], f"kill point {r['k']}: left behind {r['leftovers']}"


def test_after_any_kill_no_progress_is_lost(kills):
    for r in kills["moments"] + kills["real_kills"]:
        where = f"kill point {r['k']}"
        final = r["complete"].get("s1/final")
        assert final is not None, f"{where}: the final checkpoint is gone"
        assert final["step"] in (100, 3) and final["hf"], f"{where}: {final}"
        if final["step"] == 100:  # the new final is not there yet: resume from step 2 or 3
            assert r["resume"] in ("s1/checkpoints/step_000002", "s1/checkpoints/step_000003"), \
                f"{where}: resume from {r['resume']}"
        else:  # the stage's result is in place; its step checkpoints may be gone
            assert r["resume"] in (None, "s1/checkpoints/step_000003"), f"{where}: {r['resume']}"
    end = kills["moments"][-1]
    assert end["event"] == "end" and end["complete"]["s1/final"]["step"] == 3 and end["resume"] is None


def test_real_kills_leave_what_the_moments_say(kills):
    moments = {m["k"]: m for m in kills["moments"]}
    for r in kills["real_kills"]:
        want = moments[r["k"]]
        got = {n: e["step"] for n, e in r["complete"].items()}
        assert got == {n: e["step"] for n, e in want["complete"].items()}, f"kill point {r['k']}"
        assert r["resume"] == want["resume"], f"kill point {r['k']}"
