"""The global gradient norm of replicated (non-sharded) gradients, through ``parallel/comm.py``.

DP reduction and the SP norms' TP sum happen in ``parallel/ddp.py`` (buckets); the sharded optimizer computes the
norm from its owned chunks (``parallel/dist_optim.py``). Here: after the DP reduction every DP rank holds the same
gradients, so the norm counts TP shards once each and TP-replicated parameters once, summed over the
model-parallel (TP × PP) group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from megasparse.parallel import comm, state

__all__ = ["global_grad_norm", "norm_over"]


def global_grad_norm(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], is_sharded: Callable[[str], bool], device: torch.device
) -> float:
    """L2 norm of the whole model's gradient: TP shards summed over TP × PP, replicated parameters counted once."""
    tp_rank = state.layout().tp_rank
    grads = [
        p.grad
        for name, p in named_params
        if p.grad is not None and (is_sharded(name) or tp_rank == 0) and not getattr(p, "tied_copy", False)
    ]  # a tied embedding's last-stage copy holds the same gradient as the first stage's: counted there
    return norm_over(grads, state.mp_group(), "mp", device)


def norm_over(grads: list[torch.Tensor], group, group_name: str, device: torch.device) -> float:
    """L2 norm of ``grads`` summed (squared) over ``group``: each rank passes the pieces it counts."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    with comm.phase("optim"):
        comm.all_reduce(sq, group, group_name, region="grads.norm")
    return math.sqrt(sq.item())
