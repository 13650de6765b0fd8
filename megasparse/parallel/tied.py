"""Tied input/output embeddings under pipeline parallelism: the first stage's embedding and the last stage's copy
of it (the output layer) get the sum of both gradients, as Megatron's embedding group does, so the two copies take
identical optimizer steps and stay equal (decision 1100). At pp = 1 the two are one parameter and nothing runs."""

from __future__ import annotations

import torch

from megasparse.parallel import comm


def tied_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """This rank's copy of a pp > 1 tied embedding (the first stage's embedding or the last stage's output layer)."""
    if not getattr(model, "tied", False) or model.layout.pp == 1:
        return None
    if getattr(model, "last", False):
        return model.output_weight
    return model.embedding.weight if getattr(model, "first", False) else None


def sum_tied_grads(model: torch.nn.Module, group) -> None:
    """After the DP reduction: each copy's gradient becomes the sum of both (``group``: the embedding group, passed
    in by the optimizer that owns the reduction, as the layers get theirs)."""
    p = tied_embedding(model)
    if p is None or p.grad is None:
        return
    with comm.phase("optim"):
        comm.all_reduce(p.grad, group, "embedding", region="tied.embedding_grads")
