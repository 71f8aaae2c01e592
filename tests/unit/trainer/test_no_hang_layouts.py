"""The in-process engine beside a multi-process trainer hung (issue 27: `torchrun --nproc-per-node 2
... policy.parallel.context_parallel=2` on the demo config, no step for minutes): vLLM in the trainer's
process builds its process groups on the trainer's torch.distributed world, so rank 0 waited in
vLLM's group creation for ranks that were already waiting in the trainer's next collective. Every
layout of more than one rank does this (TP, PP, CP, or data parallel from torchrun alone). Each is
refused before anything starts: TP / PP / CP > 1 when the config is validated, more trainer
processes than one (WORLD_SIZE) at the entry point, before the world starts."""

from __future__ import annotations

import itertools

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError
from megatron_rl.trainer.schema import check_world_size, load_run_config
from tests.unit.test_entry_point_errors import DEMO, check_one_line

SERVERS = ["rollout.engine=vllm_server", "rollout.placement=external", "rollout.server_urls=[http://127.0.0.1:1]",
           "sync.transport=gloo"]
LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel", "context_parallel")


@pytest.mark.parametrize("tp,pp,cp,staleness", [c for c in itertools.product((1, 2), (1, 2), (1, 2), (0, 1))])
def test_no_hang_every_layout_with_the_in_process_engine_is_refused_at_validation(tp, pp, cp, staleness):
    overrides = [f"policy.parallel.tensor_parallel={tp}", f"policy.parallel.pipeline_parallel={pp}",
                 f"policy.parallel.context_parallel={cp}", f"rollout.async.max_staleness={staleness}"]
    if (tp, pp, cp) == (1, 1, 1):
        cfg = load_run_config(DEMO, overrides)
        check_world_size(cfg, 1)  # one process: runs (the demo)
        with pytest.raises(ConfigError, match=r"rollout\.engine.*WORLD_SIZE=2.*vllm_server"):
            check_world_size(cfg, 2)  # data parallel from torchrun alone
        return
    with pytest.raises(ConfigError) as e:
        load_run_config(DEMO, overrides)
    first = next(k for k, n in zip(LAYOUT_KEYS, (tp, pp, cp)) if n > 1)
    assert e.value.key == f"policy.parallel.{first}" and "rollout.engine='vllm'" in str(e.value)
    assert "waits for the others forever" in str(e.value) and "vllm_server" in str(e.value)
    # ... and with the engines in their own processes the same layout validates, checked against
    # the number of processes before the world starts
    cfg = load_run_config(DEMO, [*overrides, *SERVERS])
    check_world_size(cfg, tp * pp * cp)
    check_world_size(cfg, 2 * tp * pp * cp)
    with pytest.raises(ConfigError, match=r"ranks needed but only 1 processes are running \(WORLD_SIZE\)"):
        check_world_size(cfg, 1)
    if tp * pp * cp == 4:
        with pytest.raises(ConfigError, match=r"does not divide the world size 6 \(WORLD_SIZE\)"):
            check_world_size(cfg, 6)


@pytest.mark.parametrize("rank,world,extra,says", [
    ("0", "2", ["policy.parallel.context_parallel=2"], ("'policy.parallel.context_parallel'", "vllm_server")),
    ("1", "2", [], ("(rank 1)", "'rollout.engine'", "WORLD_SIZE=2")),
    ("0", "3", [*SERVERS, "policy.parallel.tensor_parallel=2"], ("does not divide the world size 3 (WORLD_SIZE)",)),
])
def test_no_hang_the_demo_under_torchrun_says_why_in_one_line(capsys, monkeypatch, tmp_path, rank, world, extra, says):
    """What each rank of `torchrun --nproc-per-node N -m megatron_rl.cli demo ...` prints (its
    environment, in process): one line, exit 2, before the world or any model starts."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # (torchrun sets them too; nothing listens: refused before)
    monkeypatch.setenv("MASTER_PORT", "29500")
    code = main(["demo", "--run-dir", str(tmp_path / "run"), *extra])
    out, err = capsys.readouterr()
    check_one_line(code, out, err, *says)
    assert not (tmp_path / "run").exists()  # nothing started


def test_no_hang_a_failed_collective_names_what_it_waited_for():
    """The wrapper every trainer-level collective goes through (the real gloo timeout on 4 ranks:
    tests/integration/models/test_context_parallel.py)."""
    from megatron_rl.models.parallel import CollectiveError, named_collective

    def broadcast_the_batch():
        with named_collective("the step's batch", 42.0):
            raise RuntimeError("[gloo] Timed out waiting 42000ms for recv operation to complete\nsecond line")

    with pytest.raises(CollectiveError) as e:
        broadcast_the_batch()
    assert str(e.value).startswith("rank 0: the step's batch in broadcast_the_batch (test_no_hang_layouts.py:")
    assert "Timed out waiting 42000ms" in str(e.value) and "second line" not in str(e.value)
    assert "policy.parallel.timeout_s=42s" in str(e.value)
    with pytest.raises(ValueError):  # not a collective's failure: as it is
        with named_collective("x", 1.0):
            raise ValueError("a bug")


def test_no_hang_an_expert_grid_that_does_not_fit_the_world_is_refused_before_it_starts():
    """EP x ETP x PP must divide the number of trainer processes: said at the entry point (WORLD_SIZE),
    before the world starts, not by Megatron's group construction on every rank."""
    moe = DEMO.replace("demo_cpu.yaml", "demo_moe_cpu.yaml")
    cfg = load_run_config(moe, [*SERVERS, "policy.parallel.expert_parallel=4"])
    check_world_size(cfg, 4)
    check_world_size(cfg, 8)
    with pytest.raises(ConfigError) as e:
        check_world_size(cfg, 6)
    assert e.value.key == "policy.parallel.expert_parallel", e.value.key
    assert "expert_tensor_parallel (1) x expert_parallel (4) x pipeline_parallel (1) = 4 does not divide the " \
           "world size 6 (WORLD_SIZE)" in str(e.value)
