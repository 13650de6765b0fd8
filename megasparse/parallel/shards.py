"""Where a rank's tensors sit in the layout-independent global model (checkpoints that reshard).

Every parameter has a *logical* global tensor, named by its global key (``global_name``: stage-local layer
``i`` becomes the global layer id) and shaped as in a tp = pp = 1 run with the padding rows of the vocabulary
dropped. A rank's local tensor is one or more *pieces* of it, cut along one dimension:

* column-parallel linears (``tp_spec = (0, partitions)``): each partition (q|k|v of the fused GQA projection,
  gate|up of SwiGLU's fc1) was chunked over TP separately, so a rank holds one row block of every partition —
  e.g. rows [q_r; k_r; v_r] — and the global tensor is the tp = 1 concatenation [q; k; v], not a concat of ranks;
* row-parallel linears (``tp_spec = (1, [in])``): one column block;
* vocabulary matrices (``vocab_rows = (start, vocab)``: embedding, output layer, their pipeline slices under
  ``loss.vocab_over_pp`` / ``embedding_over_pp``): the rows [start, start + local) ∩ [0, vocab); padding rows
  (whose count depends on tp and pp) are zeros that no loss reads, so they are neither saved nor loaded;
* anything else (norms, scalars) is replicated: the whole tensor, one piece at offset 0.

Optimizer moments and 2:4 masks are shaped like their parameter and carry its attributes (``shard_like``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTRS = ("tp_spec", "vocab_rows")


@dataclass(frozen=True)
class Placement:
    """A local tensor's place in its global tensor: ``pieces`` are (local start, global start, length) along
    ``dim``; the other dimensions are whole."""

    shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int, int], ...]
    replicated: bool

    def chunks(self, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """(global offsets, view of ``t``) of every piece."""
        if t.dim() == 0:
            return [((), t)]
        out = []
        for local, start, n in self.pieces:
            offsets = [0] * t.dim()
            offsets[self.dim] = start
            out.append((tuple(offsets), t.narrow(self.dim, local, n)))
        return out


def global_name(model: torch.nn.Module, name: str) -> str:
    """The layout-independent key of local parameter ``name``: the model's own map (``GPTStage.global_name``:
    stage-local ``layers.<i>.`` becomes the global layer id; ``StageChunks.global_name`` under virtual pipeline
    stages: ``chunks.<c>.…`` becomes chunk c's global name)."""
    return model.global_name(name)


def shard_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like parameter ``like``: a mask, a moment) marked to shard exactly like it."""
    for a in _ATTRS:
        if hasattr(like, a):
            setattr(t, a, getattr(like, a))
    return t


def placement(t: torch.Tensor, tp: int, tp_rank: int) -> Placement:
    """Where ``t`` (a parameter, or a tensor marked by ``shard_like``) of TP rank ``tp_rank`` lies globally."""
    shape = tuple(t.shape)
    rows = getattr(t, "vocab_rows", None)
    if rows is not None:
        start, vocab = rows
        lo, hi = max(start, 0), min(start + shape[0], vocab)
        pieces = ((lo - start, lo, hi - lo),) if hi > lo else ()
        return Placement((vocab, *shape[1:]), 0, pieces, replicated=False)
    spec = getattr(t, "tp_spec", None)
    if spec is None:
        return Placement(shape, 0, ((0, 0, shape[0]),) if shape else (), replicated=True)
    dim, parts = spec
    full = list(shape)
    full[dim] = sum(parts)
    return Placement(tuple(full), dim, tp_pieces(parts, tp, tp_rank), replicated=False)


def tp_pieces(parts: list[int], tp: int, tp_rank: int) -> tuple[tuple[int, int, int], ...]:
    """(local start, global start, length) of TP rank ``tp_rank``'s block of each partition along the split
    dimension: every partition (q|k|v, gate|up) is chunked over TP separately (``consolidate.unshard`` too)."""
    pieces, local, glob = [], 0, 0
    for size in parts:
        per = size // tp
        pieces.append((local, glob + tp_rank * per, per))
        local, glob = local + per, glob + size
    return tuple(pieces)
