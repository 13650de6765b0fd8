"""Token filtering on chunks (``filter.mode=loss_mask`` and ``collider``, decisions 1222 and 1223): Rho-1's selection
over each chunk's real predictions only, with ``filtering/selection.py``'s scorers and top-k.

A chunk's candidates are its real label slots (padding and the slots between packed documents are never scored,
so never kept); it keeps ``ceil(keep_ratio · real)`` of them, a count the plan fixes, so the step's kept total —
the loss normaliser — is known on every rank. The selection reads only the chunk's own per-token losses (or a
generator seeded by the step and the chunk's first token), so a rerun chunk would select the same tokens (the step
reuses the first forward's anyway). Under collider the step hands the kept rows to the loss layer, and the chunk's
backward is compact (``ops/prefix_attention.py`` across chunk boundaries, decision 1223).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megasparse.chunkflow.plan import IGNORE, Chunk, StepPlan
from megasparse.filtering.selection import kept_count, score_tokens, select_tokens

__all__ = ["ChunkSelection"]


@dataclass
class ChunkSelection:
    """``filter.keep_ratio`` of each chunk's real predictions, by ``filter.scorer`` (loss or random)."""

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

    def rows(self, per_token: torch.Tensor, labels: np.ndarray, chunk: Chunk, step: int) -> torch.Tensor:
        """The chunk's kept real predictions, ascending ([k] on ``per_token``'s device, no host sync);
        ``labels``: the chunk's, IGNORE where not real."""
        real = torch.from_numpy(np.flatnonzero(labels != IGNORE)).to(per_token.device)
        gen = None
        if self.scorer == "random":
            first = chunk.pieces[0]
            gen = torch.Generator(device=per_token.device)
            gen.manual_seed((self.seed * 1_000_003 + step) * 1_000_003 + first.seq * 10_007 + first.start)
        scores = score_tokens(self.scorer, per_token.detach()[real], generator=gen)
        return real[select_tokens(scores, self.keep_ratio, "microbatch").idx]

    def weights(self, per_token: torch.Tensor, labels: np.ndarray, chunk: Chunk, step: int) -> torch.Tensor:
        """[C]: 1 at the chunk's kept real predictions, else 0."""
        return torch.zeros_like(per_token).index_fill_(0, self.rows(per_token, labels, chunk, step), 1.0)
