"""GPU: the KL reference policy offloaded to host memory between uses (policy.reference.offload)
scores exactly as the one kept on the GPU, and its weights are on the CPU between calls (skips on CPU).

Plain pytest on a GPU machine (one rank, nccl).
"""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "models"))
from policy_testlib import LENGTHS, PROMPTS, make_batch, write_hf_model  # noqa: E402


def test_offloaded_reference_matches_the_resident_one(tmp_path, monkeypatch):
    from megatron_rl.models import ParallelConfig, PolicyConfig, destroy_distributed, init_distributed
    from megatron_rl.models.config import ReferenceConfig
    from megatron_rl.models.reference import ReferencePolicy

    import socket

    with socket.socket() as s:  # a free port for the one-rank world
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    hf = write_hf_model(tmp_path / "m", "qwen2", tie=True, kv_heads=1)
    from megatron_rl.compat import apply_compat

    apply_compat()  # the entry point's one explicit call (the Megatron fixes; no shim with CUDA)
    groups = init_distributed(ParallelConfig())
    try:
        batch = make_batch(LENGTHS, PROMPTS)
        resident = ReferencePolicy.from_hf(str(hf), PolicyConfig(), groups)
        offloaded = ReferencePolicy.from_hf(str(hf), PolicyConfig(reference=ReferenceConfig(offload=True)),
                                            groups)
        assert all(p.device.type == "cuda" for c in resident.model for p in c.parameters())
        assert all(p.device.type == "cpu" for c in offloaded.model for p in c.parameters())
        want, _ = resident.compute_logprobs(batch, 0.7)
        got, _ = offloaded.compute_logprobs(batch, 0.7)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert all(p.device.type == "cpu" for c in offloaded.model for p in c.parameters())
    finally:
        destroy_distributed()
