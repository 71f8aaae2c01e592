"""Rollout configuration: how responses are sampled and how the engine is set up."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.base import ConfigBase


@dataclass(kw_only=True)
class RolloutConfig(ConfigBase):
    # Which engine: "vllm" (in-process, the CPU demo) or "vllm_remote" (own process; see sync/).
    engine: str = "vllm"
    # Data-parallel engine replicas; each step's prompts are split among them. More than one needs
    # engine "vllm_remote" (each engine in its own process).
    num_engines: int = 1
    # Prompts per step (the seed's rollout batch size).
    rollout_batch_size: int = 64
    # Responses sampled per prompt (the GRPO group size).
    group_size: int = 8
    # Sampling temperature; log-probs for the ratio are recomputed at this same temperature.
    temperature: float = 1.0
    # Nucleus sampling; the recomputed log-probs honour it through vLLM's processed log-probs.
    top_p: float = 1.0
    # -1 disables top-k.
    top_k: int = -1
    # Maximum response length in tokens; each stage overrides it (8k -> 16k -> 32k in the recipe).
    max_response_len: int = 64
    # Maximum prompt length in tokens (longer prompts are filtered by the data loader).
    max_prompt_len: int = 64
    # vLLM: dtype of the engine weights ("float32" on CPU; "bfloat16" on GPUs).
    dtype: str = "float32"
    # vLLM: bytes of KV cache (CPU needs an explicit size); 0 lets vLLM decide (GPU).
    kv_cache_bytes: int = 256 * 1024 * 1024
    # vLLM: gpu_memory_utilization (GPU only).
    gpu_memory_utilization: float = 0.5
    # vLLM tensor parallel size per engine.
    tensor_parallel_size: int = 1
    # vLLM: run without CUDA graphs / compilation (required on CPU, faster start).
    enforce_eager: bool = True
    # vLLM: maximum sequences batched together.
    max_num_seqs: int = 256
    # Seconds a generate call may take before it is treated as a hung engine.
    timeout_s: float = 600.0
    # Greedy evaluation: how many tokens the evaluation may generate (defaults to max_response_len).
    eval_max_tokens: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.engine not in ("vllm", "vllm_remote"):
            self.fail("engine", f"must be 'vllm' or 'vllm_remote', got {self.engine!r}")
        if self.num_engines > 1 and self.engine != "vllm_remote":
            self.fail("num_engines", f"{self.num_engines} engines need engine='vllm_remote' (one process each)")
        for name in ("num_engines", "rollout_batch_size", "group_size", "max_response_len", "max_prompt_len",
                     "tensor_parallel_size", "max_num_seqs"):
            self.check_range(name, lo=1)
        self.check_range("temperature", lo=0.0, lo_open=True)
        self.check_range("top_p", lo=0.0, hi=1.0, lo_open=True)
        if self.top_k == 0 or self.top_k < -1:
            self.fail("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        self.check_range("timeout_s", lo=0.0, lo_open=True)
