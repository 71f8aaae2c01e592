"""Run Megatron-Core without CUDA: the one place that patches torch and Megatron for the CPU.

Megatron-Core 0.16.1 assumes a GPU in a handful of spots even when the model itself is on the CPU
(``use_cpu_initialization=True``) and the collectives go through gloo. With the patches below its
tensor-, pipeline- and data-parallel code paths (incl. the distributed optimizer and distributed
checkpointing) run on the CPU and give the single-rank numbers exactly.

:func:`apply_cpu_shim` (process-wide, idempotent):

* ``torch.cuda.current_device`` returns the CPU device (Megatron allocates with
  ``device=torch.cuda.current_device()``, also inside backward functions) and ``synchronize`` does
  nothing; ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on the CPU generator (the RNG
  tracker of ``tensor_parallel.random`` forks "the CUDA RNG", which on the CPU is the CPU RNG);
* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator;
* the per-step Megatron modules that allocate with ``device="cuda"`` (the pipeline schedules'
  token counter, the default causal mask) see a ``torch`` whose factory functions put such tensors
  on the CPU;
* Megatron's per-step context-parallel helpers that make a pinned index tensor and move it with
  ``.cuda()`` (``get_pos_emb_on_this_cp_rank``: this CP rank's rotary angles) run inside
  :func:`megatron_cpu_scope`, which also drops ``pin_memory`` (there is no pinned allocator);
* Mixture-of-Experts, the alltoall token dispatcher (``moe/token_dispatcher.py``): its module sees a
  ``torch.cuda`` whose ``Stream`` / ``current_stream`` / ``stream`` are no-op stand-ins (it copies
  the routing counts to the host on a side CUDA stream; on the CPU they are there already), and its
  ``maybe_move_tensor_to_cpu`` turns the all-to-all split sizes into numpy arrays for CPU tensors
  too (Megatron's converts only CUDA tensors, and gloo's ``all_to_all_single`` refuses tensor split
  sizes: a TypeError at expert parallelism > 1);
* Mixture-of-Experts with expert tensor parallelism > 1: the dispatcher gathers each expert-TP
  rank's tokens (``tensor_parallel.mappings._gather_along_first_dim`` with uneven split sizes), and
  gloo's ``all_gather`` needs equal sizes: uneven shares are padded to the largest, all-gathered and
  cut back (equal sizes go Megatron's way).

:func:`megatron_cpu_scope` (a context manager, for the one-off and optimizer calls): a
:class:`~torch.overrides.TorchFunctionMode` redirects every tensor created or moved to ``"cuda"`` /
``cuda:N`` / an integer device to the CPU, turns ``Tensor.cuda()`` into a no-op and reports CPU
float tensors as ``torch.cuda.*Tensor`` from the argument-less ``Tensor.type()`` (Megatron asserts
on that string in ``clip_grads`` and its optimizers). It is scoped, not global: a mode puts every
torch call through Python (~25% slower forward/backward on a tiny model), and other code (vLLM in
the same process) should not see it. A mode is also switched off while it handles a call, so it
never reaches into ``backward()``: backward code relies on ``current_device()`` above.

Nothing is patched when CUDA is available: both are then no-ops.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
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
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
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


class _CpuFactoryTorch:
    """Stands in for ``torch`` inside a Megatron module: factory calls asked for a CUDA device get
    the CPU; every other attribute is torch's own."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
                  "empty_like")

    def __init__(self):
        for name in self._FACTORIES:
            setattr(self, name, self._redirect(getattr(torch, name)))

    @staticmethod
    def _redirect(factory):
        def call(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _CPU
            return factory(*args, **kwargs)

        return call

    def __getattr__(self, name):
        return getattr(torch, name)


# Megatron modules that allocate on "cuda" on every step (outside megatron_cpu_scope).
_PER_STEP_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.transformer.utils")


def _patch_megatron_factories() -> None:
    import importlib

    proxy = _CpuFactoryTorch()
    for name in _PER_STEP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # megatron-core absent
            continue
        module.torch = proxy


# (module, function) pairs of per-step Megatron helpers that run inside megatron_cpu_scope; every
# module that imported the function by name is listed with it.
_SCOPED_FUNCTIONS = (
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
     "get_pos_emb_on_this_cp_rank"),
)


def _patch_megatron_scoped() -> None:
    import functools
    import importlib

    for module_name, name in _SCOPED_FUNCTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # megatron-core absent
            continue
        original = getattr(module, name, None)
        if original is None or getattr(original, "_megatron_rl_scoped", False):
            continue

        @functools.wraps(original)
        def scoped(*args, _original=original, **kwargs):
            with _CudaToCpuMode():
                return _original(*args, **kwargs)

        scoped._megatron_rl_scoped = True
        setattr(module, name, scoped)


class _NoStream:
    """A CUDA stream / event stand-in: on the CPU every copy is synchronous, so waiting is a no-op."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass


class _CpuStreamsCuda:
    """``torch.cuda`` with no-op streams (``Stream``, ``current_stream``, ``stream``); every other
    attribute is torch.cuda's own."""

    _DEFAULT = _NoStream()

    Stream = _NoStream

    @staticmethod
    def current_stream(device=None) -> _NoStream:
        return _CpuStreamsCuda._DEFAULT

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuStreamsTorch:
    """``torch`` for the MoE token dispatcher: its ``cuda`` has no-op streams (see above)."""

    cuda = _CpuStreamsCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _host_splits(original):
    """Megatron's ``maybe_move_tensor_to_cpu``, also giving numpy for CPU tensors when asked."""

    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._megatron_rl_host_splits = True
    return move


def _uneven_gather(original):
    """``_gather_along_first_dim`` whose uneven split sizes go through an equal-size all_gather."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    gather._megatron_rl_uneven = True
    return gather


def _patch_megatron_moe() -> None:
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:  # megatron-core absent
        return
    token_dispatcher.torch = _CpuStreamsTorch()
    move = token_dispatcher.maybe_move_tensor_to_cpu
    if not getattr(move, "_megatron_rl_host_splits", False):
        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits(move)
    from megatron.core.tensor_parallel import mappings

    if not getattr(mappings._gather_along_first_dim, "_megatron_rl_uneven", False):
        mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)



def cpu_shim_active() -> bool:
    """Whether :func:`apply_cpu_shim` has patched this process."""
    return bool(_STATE["applied"])


def apply_cpu_shim() -> bool:
    """Make Megatron-Core run on the CPU; returns True when the shim is active.

    A no-op returning False when CUDA is available. Idempotent.
    """
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _STATE["applied"]:
            _patch_torch_cuda()
            _patch_megatron_rng()
            _patch_megatron_factories()
            _patch_megatron_scoped()
            _patch_megatron_moe()
            _STATE["applied"] = True
    return True


@contextlib.contextmanager
def megatron_cpu_scope():
    """Inside: CUDA placements go to the CPU (see the module doc). A no-op without the shim."""
    if not _STATE["applied"]:
        yield
        return
    with _CudaToCpuMode():
        yield
