"""The one interface to Megatron-Core's global parallel state.

:func:`init_distributed` starts (or joins) the torch.distributed world, checks the layout,
initialises Megatron's ``parallel_state`` and model-parallel RNG, and returns a
:class:`ParallelGroups` holding the process groups explicitly. Everything else in the project takes
a ``ParallelGroups`` and never touches ``megatron.core.parallel_state`` or the model-parallel RNG
tracker: what it needs from them (a chunk's place in the pipeline, the RNG states a checkpoint
keeps, a barrier) is asked here.

The entry point applies the CPU shim (without CUDA) and the Megatron fixes first
(``megatron_rl.compat.apply_compat()``, one explicit call); :func:`init_distributed` refuses to start
if it was not made, and uses gloo when the shim is active.

Works under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment, checked whole
first: ``common/launch_env.py``) and in a plain process (a one-rank world on a private file store).
Calling it again with another layout destroys the old layout's process groups (every group Megatron
made: megatron-core 0.16.1's own ``destroy_model_parallel`` only drops its handles to most of them,
and each gloo group keeps its threads) and builds new ones (so a test can build several policies in one process); a
:class:`ParallelGroups` from before then reports itself stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_rl.common.launch_env import LaunchEnv, check_device, meeting_failed, read_launch_env
from megatron_rl.compat import compat_applied, cpu_shim_active, megatron_cpu_scope
from megatron_rl.config.base import ConfigError
from megatron_rl.models.config import ParallelConfig

_GENERATION = {"value": 0, "layout": None}
# The process groups the last ``initialize_model_parallel`` created on this rank (every kind: TP, PP,
# DP, CP, embedding, the mixed and expert groups, their gloo twins). megatron-core 0.16.1's
# ``destroy_model_parallel`` only drops its handles to most of them; each gloo group keeps its
# threads (3 per group) until it is destroyed, so re-initialising leaked ~50 threads per layout on
# one rank and ~950 per rank in a torchrun that builds ~30 layouts.
_CREATED_GROUPS: list = []


class CollectiveError(RuntimeError):
    """A collective of the trainer's ranks failed or ran out of time; the message names which one,
    where it was called, and the timeout it waited."""


@contextlib.contextmanager
def named_collective(what: str, timeout_s: float, depth: int = 2):
    """Run a collective so that its failure names what it waited for: ``what`` and the caller
    ``depth`` frames up (its function, file and line), the rank, and ``timeout_s`` (torch's own
    message names none of them)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # torch's DistBackendError / DistNetworkError, gloo's timeouts
        frame = sys._getframe(depth)
        where = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CollectiveError(f"rank {rank}: {what} in {where} failed: {first} (every rank must reach it; it "
                              f"waits at most policy.parallel.timeout_s={timeout_s:g}s: another rank died, hung, "
                              f"or waits in another collective)") from exc


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model dimensions a layout must divide (from the HF config)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    moe_ffn_hidden_size: int = 0  # each routed expert's SwiGLU width


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelGroups:
    """Process groups and ranks of one layout; pass it around instead of using global state."""

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    vpp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    # Global ranks of this rank's pipeline (stage order) and tensor-parallel group.
    pp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    backend: str
    device: torch.device
    timeout_s: float
    generation: int
    sequence_parallel: bool = False
    # Context parallelism: this rank's place in its CP group (ranks that share a sequence).
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    # Mixture-of-Experts: the expert grid (expert TP x EP x PP x expert DP over the same ranks).
    # This rank holds routed experts [ep_rank * E / ep, (ep_rank + 1) * E / ep) of its stage's
    # layers, each split over its expert-TP group; expert-DP ranks hold the same ones.
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    edp: int = 1
    edp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    # Global ranks of this rank's expert-TP group (in ETP rank order).
    etp_ranks: tuple[int, ...] = (0,)
    # expert_owners[pp_rank][ep_rank]: the global rank holding that stage's experts of that EP rank
    # at expert-TP rank 0 of expert-DP replica 0 (where an export gathers them).
    expert_owners: tuple[tuple[int, ...], ...] = ((0,),)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def global_rank(self, *, pp: int, tp: int = 0, cp: int = 0, dp: int = 0) -> int:
        """The global rank at these coordinates of this layout (Megatron's rank order
        ``tp-cp-ep-dp-pp``: tensor-parallel ranks are neighbours, pipeline stages the outermost
        blocks; :func:`init_distributed` checks every rank's own coordinates against it). Any rank
        can name any other without communicating: e.g. each stage's TP-rank-0 of replica 0, the rank
        that sends that stage's weights (``models.hf_export.export_plan``)."""
        for name, value, size in (("pp", pp, self.pp), ("tp", tp, self.tp), ("cp", cp, self.cp),
                                  ("dp", dp, self.dp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} rank {value} is outside this layout's {name} size {size}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def barrier(self, what: str = "a barrier of every rank") -> None:
        """Wait for every rank of the world (a no-op in a one-rank world); a failure or a timeout
        names ``what`` and the caller (:func:`named_collective`)."""
        if self.world_size > 1:
            with named_collective(what, self.timeout_s, depth=3):
                dist.barrier()

    def check_current(self) -> None:
        """Raise if Megatron's groups were rebuilt for another layout since these were made."""
        if self.generation != _GENERATION["value"]:
            raise RuntimeError(
                f"these ParallelGroups (TP={self.tp}, PP={self.pp}, CP={self.cp}, DP={self.dp}, "
                f"EP={self.ep}, ETP={self.etp}) are stale: "
                f"init_distributed was called again with layout {_GENERATION['layout']}")


def check_layout(cfg: ParallelConfig, world_size: int, shape: ModelShape | None = None) -> int:
    """Check that the layout fits the world and the model; return the data-parallel size.

    Raises :class:`ConfigError` naming the config key and the offending values.
    """
    cfg.validate()
    _check_expert_layout(cfg, world_size, shape)
    tp, pp, cp = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel
    dp = cfg.check_world(world_size)
    if shape is not None:
        if shape.num_heads % tp:
            cfg.fail("tensor_parallel", f"num_attention_heads ({shape.num_heads}) is not divisible "
                     f"by tensor_parallel ({tp})")
        if shape.num_kv_heads % tp:
            cfg.fail("tensor_parallel", f"num_key_value_heads ({shape.num_kv_heads}) is not "
                     f"divisible by tensor_parallel ({tp})")
        if cp > 1 and cfg.cp_comm_type == "a2a":  # TE's all-to-all splits each rank's heads over CP
            for what, heads in (("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads)):
                if (heads // tp) % cp:
                    cfg.fail("cp_comm_type", f"'a2a' splits the attention heads of each tensor-parallel rank "
                                             f"over context_parallel ({cp}), but {what} ({heads}) / "
                                             f"tensor_parallel ({tp}) = {heads // tp} is not divisible by it: "
                                             f"use p2p or all_gather")
        stages = pp * cfg.vpp
        if shape.num_layers % stages:
            name = "virtual_pipeline" if cfg.vpp > 1 else "pipeline_parallel"
            cfg.fail(name, f"num_hidden_layers ({shape.num_layers}) is not divisible by "
                     f"pipeline_parallel ({pp}) x virtual_pipeline ({cfg.vpp}) = {stages}")
    return dp


def _check_expert_layout(cfg: ParallelConfig, world_size: int, shape: ModelShape | None) -> None:
    """The expert grid: refused for dense models; EP x ETP x PP divides the world, EP the experts,
    ETP each expert's width; tensor parallelism with experts needs sequence parallelism."""
    ep, etp = cfg.expert_parallel, cfg.etp
    if shape is not None and shape.num_experts == 0:
        for key, value in (("expert_parallel", ep), ("expert_tensor_parallel",
                                                      cfg.expert_tensor_parallel)):
            if value not in (None, 1):
                cfg.fail(key, f"={value} needs a Mixture-of-Experts model; this model is dense")
        return
    cfg.check_expert_world(world_size)
    if shape is None:
        return
    if shape.num_experts % ep:
        cfg.fail("expert_parallel", f"num_experts ({shape.num_experts}) is not divisible by "
                 f"expert_parallel ({ep})")
    if shape.moe_ffn_hidden_size % etp:
        key = "expert_tensor_parallel" if cfg.expert_tensor_parallel else "tensor_parallel"
        cfg.fail(key, f"moe_intermediate_size ({shape.moe_ffn_hidden_size}) is not divisible by "
                 f"the expert tensor-parallel size ({etp})")
    if cfg.tensor_parallel > 1 and not cfg.sequence_parallel:
        cfg.fail("sequence_parallel", f"Mixture-of-Experts models with tensor_parallel "
                 f"({cfg.tensor_parallel}) > 1 need sequence_parallel: true (Megatron's MoE layer "
                 f"refuses to train without it)")


def _start_world(env: LaunchEnv, shim: bool, timeout: datetime.timedelta) -> None:
    """Join the world ``env`` (checked) describes (gloo under the CPU shim, else NCCL on the GPU of
    LOCAL_RANK): at MASTER_ADDR:MASTER_PORT, or a one-rank world on a private file store. torch's
    rendezvous failures become one line (:func:`meeting_failed`)."""
    backend = "gloo" if shim else "nccl"
    if not shim:
        check_device(env.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(env.local_rank)
    if env.rendezvous:
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        except (dist.DistNetworkError, dist.DistStoreError) as exc:
            raise meeting_failed(env, exc, timeout.total_seconds()) from None
        return
    fd, path = tempfile.mkstemp(prefix="megatron_rl_store_")
    os.close(fd)
    os.unlink(path)  # FileStore creates it; the one-rank world needs no rendezvous address
    store = dist.FileStore(path, 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def init_distributed(cfg: ParallelConfig, timeout_s: float | None = None,
                     shape: ModelShape | None = None, seed: int = 1234) -> ParallelGroups:
    """Start or join the world, initialise Megatron's parallel state and RNG for ``cfg``.

    ``shape`` (optional) lets the layout be checked against the model before anything is built;
    :meth:`MegatronPolicy.from_hf` checks it again. ``seed`` seeds Megatron's model-parallel RNG.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    timeout_s = cfg.timeout_s if timeout_s is None else timeout_s
    shim = cpu_shim_active()
    if not compat_applied() or (not shim and not torch.cuda.is_available()):
        raise RuntimeError("the compatibility fixes are not applied: call "
                           "megatron_rl.compat.apply_compat() once at the entry point, before "
                           "init_distributed")
    env = None if dist.is_initialized() else read_launch_env()  # the whole launch contract, checked
    world_size = dist.get_world_size() if env is None else env.world_size
    dp = check_layout(cfg, world_size, shape)  # before any group or model exists
    if env is not None:
        _start_world(env, shim, datetime.timedelta(seconds=timeout_s))
    world_rank, backend = dist.get_rank(), dist.get_backend()

    layout = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.virtual_pipeline,
              cfg.context_parallel, cfg.expert_parallel, cfg.expert_tensor_parallel)
    _destroy_megatron_groups()
    before = set(_live_groups())
    try:
        with megatron_cpu_scope():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=cfg.tensor_parallel,
                pipeline_model_parallel_size=cfg.pipeline_parallel,
                virtual_pipeline_model_parallel_size=cfg.virtual_pipeline if cfg.vpp > 1 else None,
                context_parallel_size=cfg.context_parallel,
                expert_model_parallel_size=cfg.expert_parallel,
                expert_tensor_parallel_size=cfg.etp,
                distributed_timeout_minutes=max(1, int(-(-timeout_s // 60))),
            )
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    finally:  # (what a failed initialisation made is destroyed with the next one, too)
        _CREATED_GROUPS[:] = [pg for pg in _live_groups() if pg not in before]
    _GENERATION["value"] += 1
    _GENERATION["layout"] = dict(zip(("tensor_parallel", "pipeline_parallel", "virtual_pipeline",
                                      "context_parallel", "expert_parallel",
                                      "expert_tensor_parallel"), layout))
    groups = ParallelGroups(
        world_size=world_size, rank=world_rank,
        tp=cfg.tensor_parallel, pp=cfg.pipeline_parallel, dp=dp, vpp=cfg.vpp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        pp_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
        tp_ranks=tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
        backend=backend,
        device=torch.device("cpu") if shim else torch.device("cuda", torch.cuda.current_device()),
        timeout_s=timeout_s,
        generation=_GENERATION["value"],
        sequence_parallel=cfg.sequence_parallel,
        cp=cfg.context_parallel,
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        **_expert_groups(cfg, world_size),
    )
    _check_rank_order(groups)
    return groups


def _expert_groups(cfg: ParallelConfig, world_size: int) -> dict:
    """The expert grid's sizes, this rank's place in it, its groups, and where each (stage, EP rank)'s
    experts are gathered (one all-gather of every rank's coordinates)."""
    from megatron.core import parallel_state as ps

    ep, etp, pp = cfg.expert_parallel, cfg.etp, cfg.pipeline_parallel
    place = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
             ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    places = [place]
    if world_size > 1:
        places = [None] * world_size
        dist.all_gather_object(places, place)
    owners = [[-1] * ep for _ in range(pp)]
    for rank, (pp_rank, ep_rank, etp_rank, edp_rank) in enumerate(places):
        if etp_rank == 0 and edp_rank == 0:
            owners[pp_rank][ep_rank] = rank
    etp_group = ps.get_expert_tensor_parallel_group()
    return dict(
        ep=ep, ep_rank=place[1], etp=etp, etp_rank=place[2],
        edp=world_size // (ep * etp * pp), edp_rank=place[3],
        ep_group=ps.get_expert_model_parallel_group(), etp_group=etp_group,
        edp_group=ps.get_expert_data_parallel_group(),
        etp_ranks=tuple(dist.get_process_group_ranks(etp_group)),
        expert_owners=tuple(tuple(row) for row in owners),
    )


def _check_rank_order(g: ParallelGroups) -> None:
    """This rank's coordinates and its pipeline's ranks agree with :meth:`ParallelGroups.global_rank`
    (a Megatron whose rank order differs fails here, not in a sync that sends from wrong ranks)."""
    mine = g.global_rank(pp=g.pp_rank, tp=g.tp_rank, cp=g.cp_rank, dp=g.dp_rank)
    stages = tuple(g.global_rank(pp=p, tp=g.tp_rank, cp=g.cp_rank, dp=g.dp_rank) for p in range(g.pp))
    if mine != g.rank or stages != g.pp_ranks:
        raise RuntimeError(f"Megatron's rank order is not tp-cp-dp-pp: rank {g.rank} (tp {g.tp_rank}, cp "
                           f"{g.cp_rank}, dp {g.dp_rank}, pp {g.pp_rank}) computes as {mine}, its "
                           f"pipeline {g.pp_ranks} as {stages}")


def chunk_ends(groups: ParallelGroups, vp_stage: int | None) -> tuple[bool, bool]:
    """Whether this rank's model chunk ``vp_stage`` (None without virtual stages) holds the
    embedding (first stage) and the output layer (last stage): Megatron's ``pre_process`` /
    ``post_process``."""
    from megatron.core import parallel_state as ps

    groups.check_current()
    return (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def rng_tracker_states() -> dict:
    """The model-parallel RNG tracker's states (this rank's; a checkpoint keeps them)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def set_rng_tracker_states(states: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(states)


def _live_groups() -> list:
    """This rank's live process groups (torch keeps no public list; Megatron reads the same map)."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _destroy_megatron_groups() -> None:
    """Destroy every process group Megatron created for the current layout, then its state."""
    from megatron.core import parallel_state as ps

    live = set(_live_groups())
    for pg in reversed(_CREATED_GROUPS):  # Megatron's own destroy may have taken its gloo DP ones
        if pg in live and pg is not dist.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    _CREATED_GROUPS.clear()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the torch.distributed world (end of a run or a test)."""
    _destroy_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    _GENERATION["value"] += 1
    _GENERATION["layout"] = None


__all__ = ["CollectiveError", "ConfigError", "ModelShape", "named_collective", "ParallelGroups", "check_layout", "chunk_ends",
           "destroy_distributed", "init_distributed", "rng_tracker_states", "set_rng_tracker_states"]
