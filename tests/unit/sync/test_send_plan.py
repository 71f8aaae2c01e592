"""Who sends what: the export plan's senders for a layout (pure logic, a ParallelGroups without
process groups), the sync's view of it, and the config checks around several senders."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_export import export_plan, plan_senders
from megatron_rl.models.parallel import ParallelGroups
from megatron_rl.sync.base import SendPlan
from megatron_rl.trainer.schema import load_run_config

ARCH = HFArch(model_type="qwen3", vocab_size=30, hidden_size=8, ffn_hidden_size=16, num_layers=4, num_heads=2,
              num_kv_heads=1, head_dim=4, rope_theta=1e4, rms_eps=1e-6, tie_embeddings=False, qkv_bias=False,
              qk_norm=True, max_position_embeddings=32)


def _groups(tp=1, pp=1, dp=1, cp=1, vpp=1) -> ParallelGroups:
    return ParallelGroups(world_size=tp * pp * dp * cp, rank=0, tp=tp, pp=pp, dp=dp, vpp=vpp, tp_rank=0, pp_rank=0,
                          dp_rank=0, tp_group=None, pp_group=None, dp_group=None, pp_ranks=(), tp_ranks=(),
                          backend="gloo", device=torch.device("cpu"), timeout_s=1.0, generation=0, cp=cp)


def _stage(name: str, pp: int, vpp: int = 1) -> int:
    """Reference: layers cut into pp x vpp equal chunks dealt round-robin to the stages."""
    if name.startswith("model.layers."):
        chunk = int(name.split(".")[2]) // (ARCH.num_layers // (pp * vpp))
        return chunk % pp
    return 0 if "embed" in name else pp - 1


@pytest.mark.parametrize("layout", [dict(pp=2), dict(tp=2, pp=2), dict(pp=2, dp=2), dict(tp=2, pp=2, cp=2),
                                    dict(pp=2, vpp=2), dict(pp=4, tp=2)])
def test_each_stage_sends_its_own_tensors_from_its_tp_rank0_of_replica0(layout):
    g = _groups(**layout)
    plan = export_plan(ARCH, g, torch.float32)
    per_stage = g.world_size // g.pp  # Megatron's order tp-cp-ep-dp-pp: a stage is a block of ranks
    for item in plan:
        assert item.sender == _stage(item.name, g.pp, g.vpp) * per_stage, item
    assert plan_senders(plan) == [p * per_stage for p in range(g.pp)]
    # the gathered plan: the same tensors, all from rank 0
    gathered = export_plan(ARCH, g, torch.float32, to_rank=0)
    assert [i[:3] for i in gathered] == [i[:3] for i in plan] and plan_senders(gathered) == [0]
    assert len({i.name for i in plan}) == len(plan)


def test_global_rank_follows_megatrons_order_and_refuses_outside_coordinates():
    g = _groups(tp=2, pp=2, dp=2, cp=2)
    assert g.global_rank(pp=1) == 8 and g.global_rank(pp=1, tp=1, cp=1, dp=1) == 15
    assert g.global_rank(pp=0, dp=1) == 4 and g.global_rank(pp=0, cp=1) == 2
    with pytest.raises(ValueError, match="pp rank 2 is outside"):
        g.global_rank(pp=2)


def test_send_plan_indexes_senders_and_refuses_a_plan_the_driver_takes_no_part_in():
    meta = [("a", torch.float32, (2, 3), 0), ("b", torch.float32, (4,), 2), ("c", torch.bfloat16, (2,), 2)]
    plan = SendPlan.of(meta)
    assert plan.senders == (0, 2) and plan.index(2) == 1 and plan.index(1) is None
    assert plan.sender_index() == [0, 1, 1] and plan.owned(2) == [("b", torch.float32, (4,)), ("c", torch.bfloat16, (2,))]
    assert plan.nbytes() == 24 + 16 + 4 and plan.nbytes(2) == 20
    assert SendPlan.of([("a", torch.float32, (2,))]).senders == (0,)  # three fields: rank 0 sends
    with pytest.raises(ValueError, match=r"the driver \(rank 0\) sends none"):
        SendPlan.of([("a", torch.float32, (2,), 1)])


BASE = ["model.path=m", "data.train_path=x.jsonl", "stages=[{name: s1, max_response_len: 8, max_steps: 1}]"]
SERVERS = ["rollout.engine=vllm_server", "rollout.placement=external", "rollout.server_urls=[http://h:1]"]


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_one_sender_transports_refuse_owners_with_stages_or_expert_ranks_naming_the_key(transport):
    for many in ("policy.parallel.pipeline_parallel=2", "policy.parallel.expert_parallel=2"):
        with pytest.raises(ConfigError, match=f"vLLM's {transport} engine receives from one trainer rank") as e:
            load_run_config(None, [*BASE, *SERVERS, f"sync.transport={transport}", many])
        assert e.value.key == "sync.senders" and many.split(".")[-1] in str(e.value)
    for ok in (["sync.senders=gather", "policy.parallel.pipeline_parallel=2"], ["policy.parallel.tensor_parallel=2"]):
        load_run_config(None, [*BASE, *SERVERS, f"sync.transport={transport}", *ok])
    load_run_config(None, [*BASE, *SERVERS, "sync.transport=gloo", "policy.parallel.pipeline_parallel=2"])
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [*BASE, "sync.senders=all"])
    assert e.value.key == "sync.senders"


def test_engine_expert_parallel_needs_tp_and_a_moe_model(tmp_path):
    import json

    from megatron_rl.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match="tensor_parallel_size=1 there is nothing to split") as e:
        load_run_config(None, [*BASE, "rollout.expert_parallel=true"])
    assert e.value.key == "rollout.expert_parallel"
    cfg = RolloutConfig(tensor_parallel_size=2, expert_parallel=True)
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    with pytest.raises(ConfigError, match="has none"):
        cfg.check_engine(str(tmp_path / "dense"), gpus=True)
    cfg.check_engine(str(tmp_path / "moe"), gpus=True)
    with pytest.raises(ConfigError, match="vLLM's CPU MoE kernels cannot hold a share of the experts"):
        cfg.check_engine(str(tmp_path / "moe"), gpus=False)
    RolloutConfig(tensor_parallel_size=2).check_engine(str(tmp_path / "dense"), gpus=False)  # off: nothing to check
