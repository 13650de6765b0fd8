"""Process groups, on megatron-core's ``parallel_state``.

megatron-core builds the TP/PP/DP groups (rank order tp fastest, then dp, then pp) and its
layers and optimizer read them from there; megasparse reads the same groups through this thin
facade so model code never touches torch.distributed or parallel_state directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megasparse.parallel.groups import SINGLE, ProcessGroups


@dataclass(frozen=True)
class Layout:
    """This rank's place in the tp × pp × dp grid."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    sequence_parallel: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


_layout = Layout()


def layout() -> Layout:
    return _layout


def log0(msg: str) -> None:
    """Print once per run: on global rank 0, or on every process before any group exists."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def world_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun/Slurm env vars, before any group exists."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    return rank, world, local


def attempt_store(rank: int, world: int, timeout):
    """Under torchrun, the rendezvous store prefixed by the restart attempt, else None (plain env://).

    torchrun's agent store outlives a worker restart; re-initialising gloo from the same keys makes restarted
    workers read the dead attempt's addresses ("connectFullMesh failed ... Connection refused"). A prefix per
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt a clean key space, so ``--max-restarts`` recovers.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
    )
    return dist.PrefixStore(f"megasparse/attempt-{attempt}", base)


def init(tp: int, pp: int, sequence_parallel: bool = False, backend: str = "auto", timeout_s: float = 600) -> Layout:
    """Create the default group (if needed) and the megatron-core model-parallel groups, all with ``timeout_s``
    (``parallel.timeout_minutes``; megatron-core's own default would be 30 minutes for its groups)."""
    global _layout
    from datetime import timedelta

    from megatron.core import parallel_state as ps

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world, local = world_env()
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        store = attempt_store(rank, world, timedelta(seconds=timeout_s))
        kw = {"store": store} if store is not None else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=timeout_s / 60,  # a float is fine: it only feeds timedelta(minutes=...)
    )
    _make_pp_grad_group(world, pp, timedelta(seconds=timeout_s))
    _layout = Layout(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        sequence_parallel=sequence_parallel,
    )
    return _layout


_pp_grad_group = None


def _make_pp_grad_group(world: int, pp: int, timeout) -> None:
    """A second group over each pipeline's ranks, for gradients alone (``pp_grad_group``). Every rank creates every
    pipeline's group, in one order (``new_group`` is collective over the world); megatron-core numbers ranks tp
    fastest, then dp, then pp, so pipeline i is ranks i, i + world/pp, ... ."""
    global _pp_grad_group
    _pp_grad_group = None
    if pp < 2:
        return
    me, stride = dist.get_rank(), world // pp
    for i in range(stride):
        ranks = [i + k * stride for k in range(pp)]
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            assert ranks == dist.get_process_group_ranks(pp_group()), "pipeline ranks differ from megatron-core's"
            _pp_grad_group = group


def pp_grad_group():
    """The pipeline's ranks in a group of their own for the gradients that flow back, so that ChunkFlow's sends
    that never wait (decision 1249) take the two directions of a link on two communicators; None below pp 2."""
    return _pp_grad_group


def destroy() -> None:
    global _layout, _pp_grad_group
    _pp_grad_group = None
    from megatron.core import parallel_state as ps

    from megasparse.parallel import comm

    if dist.is_initialized():
        comm.settle()  # no asynchronous transfer may outlive its group
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _layout = Layout()


def groups() -> ProcessGroups:
    """The layers' process groups of this process's layout (``parallel/groups.py``): passed down at construction."""
    return ProcessGroups(tp_group(), _layout.tp, _layout.tp_rank) if _ps() is not None else SINGLE


def _ps():
    from megatron.core import parallel_state as ps

    return ps if ps.model_parallel_is_initialized() else None


def tp_group():
    ps = _ps()
    return ps.get_tensor_model_parallel_group() if ps else None


def pp_group():
    ps = _ps()
    return ps.get_pipeline_model_parallel_group() if ps else None


def dp_group():
    ps = _ps()
    return ps.get_data_parallel_group() if ps else None


def embedding_group():
    """The first and last pipeline stages of this rank's pipeline (tied embeddings sum their gradients over it)."""
    ps = _ps()
    return ps.get_embedding_group() if ps else None


def mp_group():
    """Model-parallel group (tp × pp): gradient-norm reductions span it."""
    ps = _ps()
    return ps.get_model_parallel_group() if ps else None


def pp_next_rank() -> int:
    return _ps().get_pipeline_model_parallel_next_rank()


def pp_prev_rank() -> int:
    return _ps().get_pipeline_model_parallel_prev_rank()


def pp_last_rank() -> int:
    return _ps().get_pipeline_model_parallel_last_rank()


def pp_first_rank() -> int:
    return _ps().get_pipeline_model_parallel_first_rank()
