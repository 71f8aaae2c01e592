"""Run Megatron-Core without CUDA: the one place that patches torch and Megatron for the CPU.

Megatron-Core 0.16.1 assumes a GPU in a handful of spots even when the model itself is on the CPU
(``use_cpu_initialization=True``) and the collectives go through gloo. With the patches below its
tensor-, pipeline- and data-parallel code paths (incl. the distributed optimizer and distributed
checkpointing) run on the CPU and give the single-rank numbers exactly:

* ``torch.cuda.current_device`` returns the CPU device (Megatron allocates with
  ``device=torch.cuda.current_device()``, also inside backward functions) and ``synchronize`` does
  nothing; ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on the CPU generator (the RNG
  tracker of ``tensor_parallel.random`` forks "the CUDA RNG", which on the CPU is the CPU RNG);
* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator;
* a :class:`~torch.overrides.TorchFunctionMode` redirects tensors that Megatron creates or moves to
  ``"cuda"`` / ``cuda:N`` / an integer device to the CPU, turns ``Tensor.cuda()`` into a no-op, and
  reports CPU float tensors as ``torch.cuda.*Tensor`` from the argument-less ``Tensor.type()``
  (Megatron asserts on that string in ``clip_grads`` and its optimizers). A mode is switched off
  while it handles a call, so it does not reach into ``backward()``: backward code must use
  ``current_device()`` (Megatron's does).

Nothing is patched when CUDA is available: :func:`apply_cpu_shim` is then a no-op. It is idempotent.
The device mode is entered on the calling thread (torch keeps function modes per thread), which is
the thread that drives Megatron.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_STATE = {"applied": False}


def _is_cuda_device(device: object) -> bool:
    """True for every spelling of a CUDA device: "cuda", "cuda:1", torch.device("cuda"), 0."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return False


_CPU = torch.device("cpu")


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU; every other call passes through untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            if result.startswith("torch.") and not result.startswith("torch.cuda."):
                return "torch.cuda." + result[len("torch."):]
        return result


def _cpu_get_rng_state(device: object = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # The CPU device, not 0: backward passes run outside the device mode (a mode is switched off
    # while it handles a call, here the call to backward), and Megatron's backward functions
    # allocate with ``device=torch.cuda.current_device()``.
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda device=None: None
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.random.manual_seed = _cpu_manual_seed
    cuda.random.manual_seed_all = _cpu_manual_seed


def _patch_megatron_rng() -> None:
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core absent: nothing of it to patch
        return

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def cpu_shim_active() -> bool:
    """Whether :func:`apply_cpu_shim` has patched this process."""
    return bool(_STATE["applied"])


def apply_cpu_shim() -> bool:
    """Make Megatron-Core run on the CPU; returns True when the shim is active.

    A no-op returning False when CUDA is available. Idempotent: a second call only enters the device
    mode on a thread that has not got it yet.
    """
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _STATE["applied"]:
            _patch_torch_cuda()
            _patch_megatron_rng()
            _STATE["applied"] = True
        _enter_device_mode()
    return True


_THREAD_MODES = threading.local()


def _enter_device_mode() -> None:
    if getattr(_THREAD_MODES, "mode", None) is not None:
        return
    mode = _CudaToCpuMode()
    mode.__enter__()  # stays on this thread's mode stack for the life of the process
    _THREAD_MODES.mode = mode
