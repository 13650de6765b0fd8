"""Gradient reduction after backward and the global gradient norm, through ``parallel/comm.py``.

DP: every gradient is summed over the data-parallel group in one flat buffer (the loss is already normalised by
the global token count, so a sum is the mean gradient). SP: the replicated norms see different sequence shards on
each TP rank, so their gradients are summed over TP. The norm counts TP shards once each and TP-replicated
parameters once, summed over the model-parallel (TP × PP) group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from megasparse.parallel import comm, state

__all__ = ["global_grad_norm", "reduce_gradients"]


def _all_reduce_flat(grads: list[torch.Tensor], group, group_name: str, region: str) -> None:
    """One all-reduce over the concatenation of ``grads``; results copied back through split views."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, group_name, region=region)
    for g, v in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(v.view_as(g))


def reduce_gradients(params: Iterable[torch.nn.Parameter], dp: int, sequence_parallel: bool) -> None:
    """Sum SP-replicated gradients over TP (under SP), then every gradient over DP (dp > 1)."""
    params = [p for p in params if p.grad is not None]
    with comm.phase("optim"):
        if sequence_parallel and state.layout().tp > 1:
            sp = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
            if sp:
                _all_reduce_flat(sp, state.tp_group(), "tp", "grads.sp_norms")
        if dp > 1 and params:
            _all_reduce_flat([p.grad for p in params], state.dp_group(), "dp", "grads.dp")


def global_grad_norm(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], is_sharded: Callable[[str], bool], device: torch.device
) -> float:
    """L2 norm of the whole model's gradient: TP shards summed over TP × PP, replicated parameters counted once."""
    tp_rank = state.layout().tp_rank
    grads = [p.grad for name, p in named_params if p.grad is not None and (is_sharded(name) or tp_rank == 0)]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    with comm.phase("optim"):
        comm.all_reduce(sq, state.mp_group(), "mp", region="grads.norm")
    return math.sqrt(sq.item())
