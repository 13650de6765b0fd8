"""Gather a sharded model into full tensors (for export, tests and `ref score` on other layouts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megasparse.parallel import comm, state
from megasparse.parallel.shards import tp_pieces


def unshard(shards: list[torch.Tensor], dim: int, partitions: list[int]) -> torch.Tensor:
    """Inverse of the TP split: each partition was chunked over ranks separately along ``dim``
    (``shards.tp_pieces``, the placement checkpoints use)."""
    tp = len(shards)
    if any(p % tp for p in partitions) or any(s.shape[dim] != sum(p // tp for p in partitions) for s in shards):
        raise ValueError(f"unshard: shards {[tuple(s.shape) for s in shards]} do not split {partitions} over {tp}")
    shape = list(shards[0].shape)
    shape[dim] = sum(partitions)
    out = shards[0].new_empty(shape)
    for rank, s in enumerate(shards):
        for local, start, n in tp_pieces(partitions, tp, rank):
            out.narrow(dim, start, n).copy_(s.narrow(dim, local, n))
    return out


def full_state_dict(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters (or their gradients) of the whole model, on every rank, by global names
    (``model.global_name``: a ``GPTStage`` or a rank's ``StageChunks``)."""
    comm.settle()  # parameters all-gathered asynchronously by the distributed optimizer
    lay = state.layout()
    local: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
        spec = getattr(p, "tp_spec", None)
        if spec is not None and lay.tp > 1:
            parts = [torch.empty_like(t) for _ in range(lay.tp)]
            dist.all_gather(parts, t.contiguous(), group=state.tp_group())
            t = unshard(parts, spec[0], spec[1])
        local[model.global_name(name)] = t.to("cpu", copy=True)  # a snapshot: gradient buffers are reused
    if lay.pp == 1:
        return local
    gathered: list[dict] = [None] * lay.pp  # type: ignore[list-item]
    dist.all_gather_object(gathered, local, group=state.pp_group())
    # loss.vocab_over_pp: the output weight is sliced over PP too; pp ranks hold consecutive slices
    pp_vocab = {model.global_name(n) for n, p in model.named_parameters() if getattr(p, "pp_vocab", False)}
    out: dict[str, torch.Tensor] = {}
    for d in gathered:
        for k, v in d.items():
            out[k] = torch.cat([out[k], v]) if k in pp_vocab and k in out else v
    return out
