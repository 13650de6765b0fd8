"""Token filtering on chunks (``filter.mode=loss_mask`` and ``collider``, decisions 1222, 1223 and 1227): Rho-1's
selection over each chunk's real predictions only, with ``filtering/selection.py``'s scorers and top-k.

A chunk's candidates are its real label slots (padding and the slots between packed documents are never scored,
so never kept); it keeps ``ceil(keep_ratio · real)`` of them, a count the plan fixes, so the step's kept total —
the loss normaliser — is known on every rank. The selection reads only the chunk's own per-token losses (or a
generator seeded by the step and the chunk's first token), so a rerun chunk would select the same tokens (the step
reuses the first forward's anyway). Under collider the step hands the kept rows to the loss layer, and the chunk's
backward is compact (``ops/prefix_attention.py`` across chunk boundaries, decision 1223).

``filter.scorer=excess`` (decision 1227): the step's reference (``filtering/component.py``'s, a sidecar or the
n-gram model) scores each whole sequence once, on the host, on the last stage: a sidecar at the sequence's ``.bin``
positions, the n-gram model over the document from its first token, so a later chunk's labels keep their true
in-document context. ``ChunkReference.chunk`` then places each piece's slice at the piece's label slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megasparse.chunkflow.plan import IGNORE, Chunk, StepPlan
from megasparse.filtering.selection import kept_count, score_tokens, select_tokens

__all__ = ["ChunkReference", "ChunkSelection"]


class ChunkReference:
    """Reference losses of a chunk's label slots from whole-sequence scores (0 at padding and between documents).

    ``reference``: ``filtering/component.py``'s ``Reference`` (ids, labels, label ``.bin`` positions | None), here
    called on one whole sequence (1-D): its losses are what the trainer without chunks would gather or score."""

    def __init__(self, reference) -> None:
        self.reference = reference

    def sequence(self, tokens: np.ndarray, positions: np.ndarray | None) -> torch.Tensor:
        """[L - 1] float32 on the host: the reference loss of each label ``tokens[1:]`` in its whole document;
        ``positions``: the sequence's ``.bin`` offsets (a sidecar needs them; -1: an appended end-of-document)."""
        t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        pos = None if positions is None else torch.from_numpy(np.ascontiguousarray(positions[1:], dtype=np.int64))
        return self.reference(t[:-1], t[1:], pos).float()

    @staticmethod
    def chunk(chunk: Chunk, per_sequence: dict[int, torch.Tensor], chunk_size: int) -> torch.Tensor:
        """[C]: piece ``(seq, start, count)`` at slot ``at`` holds labels ``start … start + count − 2`` of ``seq``
        (``plan.chunk_arrays``'s layout), so its slots take that slice of the sequence's reference losses."""
        out = torch.zeros(chunk_size)
        at = 0
        for p in chunk.pieces:
            out[at : at + p.count - 1] = per_sequence[p.seq][p.start : p.start + p.count - 1]
            at += p.count
        return out


@dataclass
class ChunkSelection:
    """``filter.keep_ratio`` of each chunk's real predictions, by ``filter.scorer`` (excess, loss or random)."""

    keep_ratio: float
    scorer: str
    seed: int = 0
    collider: bool = False
    """``filter.mode=collider``: the kept rows also get the compact backward (else loss_mask: a dense one)."""

    def kept(self, plan: StepPlan) -> int:
        """The step's kept predictions over every rank (the loss normaliser)."""
        return sum(self.count(c) for g in plan.groups for c in g.chunks)

    def count(self, chunk: Chunk) -> int:
        """The chunk's kept predictions (every stage knows it from the plan)."""
        return kept_count(chunk.real, self.keep_ratio)

    def rows(
        self, per_token: torch.Tensor, labels: np.ndarray, chunk: Chunk, step: int, ref: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The chunk's kept real predictions, ascending ([k] on ``per_token``'s device, no host sync);
        ``labels``: the chunk's, IGNORE where not real; ``ref``: [C] reference losses (``ChunkReference.chunk``),
        the excess scorer's."""
        real = torch.from_numpy(np.flatnonzero(labels != IGNORE)).to(per_token.device)
        gen = None
        if self.scorer == "random":
            first = chunk.pieces[0]
            gen = torch.Generator(device=per_token.device)
            gen.manual_seed((self.seed * 1_000_003 + step) * 1_000_003 + first.seq * 10_007 + first.start)
        ref_real = None if ref is None else ref.to(per_token.device)[real]
        scores = score_tokens(self.scorer, per_token.detach()[real], ref_real, generator=gen)
        return real[select_tokens(scores, self.keep_ratio, "microbatch").idx]

    def weights(
        self, per_token: torch.Tensor, labels: np.ndarray, chunk: Chunk, step: int, ref: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[C]: 1 at the chunk's kept real predictions, else 0."""
        return torch.zeros_like(per_token).index_fill_(0, self.rows(per_token, labels, chunk, step, ref), 1.0)
