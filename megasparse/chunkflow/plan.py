"""A step's chunks, built on the host from the step's whole sequences; the same on every rank (no collective).

A sequence of L tokens (end-of-document included) trains L - 1 next-token predictions: its inputs are tokens
[0, L-1), its labels tokens [1, L). A chunk is a window of ``C + 1`` token slots (C inputs, C labels, like a
fixed-length sample), where C is the chunk size (``model.seq_length``):

* a long sequence (L > C + 1) is split into ceil((L - 1) / C) consecutive chunks, chunk j holding tokens
  [j·C, j·C + C + 1) of it, the last one padded; chunk j's positions start at j·C;
* short sequences (L <= C + 1) are packed by first-fit decreasing into chunks of C + 1 token slots when the packed
  documents are kept apart (document attention), or take one chunk each when they are not (``pack=False``). With
  ``tails`` (``chunkflow.pack_tails``, decision 1233) the free slots after a long sequence's last piece are bins
  too, tried first: that chunk's first piece is the long sequence's tail (positions from the chunk's ``offset``, the
  only rows that attend to the earlier chunks), the short documents after it start at position 0 and attend within
  themselves, exactly as in a packed chunk.

Padding slots and the label slot between two packed documents are not real: their label is ``IGNORE`` (no loss, no
gradient). The loss is normalised by the step's real predictions, which every rank knows from the plan. Groups (a
long sequence's chunks, or one packed chunk) are dealt to DP ranks greedily, longest first, to the rank with the
fewest real tokens so far; a sequence's chunks stay on one rank (decision 1221).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["IGNORE", "Chunk", "Group", "StepPlan", "chunk_arrays", "plan_step"]

IGNORE = -100
"""The label of a slot that is not a real prediction (the loss's ignore index)."""


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + count) of the step's sequence ``seq`` placed in a chunk."""

    seq: int
    start: int
    count: int


@dataclass
class Chunk:
    """One micro-batch of ``C + 1`` token slots: its pieces in order and the RoPE position of its first token (of
    ``pieces[0]`` only: any later piece is a whole short document from position 0)."""

    pieces: list[Piece]
    offset: int = 0

    @property
    def real(self) -> int:
        """Real predictions: every piece's tokens but its last (the last one is only a label)."""
        return sum(p.count - 1 for p in self.pieces)

    @property
    def used(self) -> int:
        return sum(p.count for p in self.pieces)


@dataclass
class Group:
    """Chunks that run together in causal order: a long sequence's, or one packed chunk."""

    chunks: list[Chunk]

    @property
    def real(self) -> int:
        return sum(c.real for c in self.chunks)


@dataclass
class StepPlan:
    """Every group of the step, the DP rank that runs each, and the step's counts."""

    groups: list[Group]
    owner: list[int]
    dp: int
    chunk_size: int
    real_tokens: int
    """Real predictions of the whole step (the loss normaliser, the same on every rank)."""
    loads: list[int] = field(default_factory=list)
    """Real predictions per DP rank."""

    def rank_groups(self, rank: int) -> list[Group]:
        return [g for g, r in zip(self.groups, self.owner) if r == rank]

    @property
    def num_chunks(self) -> int:
        return sum(len(g.chunks) for g in self.groups)

    @property
    def slots(self) -> int:
        """Label slots of all chunks (real + padding): what the step computes."""
        return self.num_chunks * self.chunk_size


def plan_step(
    lengths: list[int],
    chunk_size: int,
    dp: int,
    pack: bool = True,
    max_length: int | None = None,
    tails: bool = True,
) -> StepPlan:
    """The step's chunks for sequences of ``lengths`` tokens (in the step's order), dealt to ``dp`` ranks.

    ``pack``: several short sequences per chunk (needs document attention); off, one each. ``tails`` (with
    ``pack``): short sequences also fill the padding of long sequences' last chunks. Sequences of fewer than 2
    tokens train nothing and get no chunk. ``max_length``: a longer sequence raises ValueError."""
    c = chunk_size
    if c < 1 or dp < 1:
        raise ValueError(f"chunk_size={chunk_size} and dp={dp} must be >= 1")
    groups: list[Group] = []
    short: list[int] = []
    bins: list[Chunk] = []  # where short sequences may go, first fit first: long tails (with ``tails``), then packs
    for i, n in enumerate(lengths):
        if max_length is not None and n > max_length:
            raise ValueError(
                f"sequence {i} of the step has {n} tokens, more than chunkflow.max_sequence_length={max_length}"
            )
        if n < 2:
            continue
        if n > c + 1:
            pieces = [Piece(i, j * c, min(c + 1, n - j * c)) for j in range(-(-(n - 1) // c))]
            groups.append(Group([Chunk([p], offset=p.start) for p in pieces]))
            if pack and tails:
                bins.append(groups[-1].chunks[-1])
        else:
            short.append(i)
    tails_at = len(bins)
    for i in sorted(short, key=lambda i: (-lengths[i], i)):  # first-fit decreasing; ties in the step's order
        n = lengths[i]
        home = next((b for b in bins if b.used + n <= c + 1), None) if pack else None
        if home is None:
            bins.append(Chunk([Piece(i, 0, n)]))
        else:
            home.pieces.append(Piece(i, 0, n))
    groups += [Group([b]) for b in bins[tails_at:]]
    owner, loads = _deal(groups, dp)
    return StepPlan(groups, owner, dp, c, sum(g.real for g in groups), loads)


def _deal(groups: list[Group], dp: int) -> tuple[list[int], list[int]]:
    """Greedy longest-first: each group (by real tokens, ties by index) to the least-loaded rank (ties: lowest)."""
    loads = [0] * dp
    owner = [0] * len(groups)
    for gi in sorted(range(len(groups)), key=lambda gi: (-groups[gi].real, gi)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        owner[gi] = r
        loads[r] += groups[gi].real
    return owner, loads


def chunk_arrays(chunk: Chunk, sequences: list[np.ndarray], chunk_size: int, pad_id: int = 0):
    """(tokens [C + 1] int64, labels [C] int64, doc_starts): the chunk's token slots (padding ``pad_id``), its
    labels with ``IGNORE`` on padding and between packed documents, and where each piece starts (slot index)."""
    tokens = np.full(chunk_size + 1, pad_id, dtype=np.int64)
    labels = np.full(chunk_size, IGNORE, dtype=np.int64)
    at, starts = 0, []
    for p in chunk.pieces:
        tokens[at : at + p.count] = sequences[p.seq][p.start : p.start + p.count]
        labels[at : at + p.count - 1] = tokens[at + 1 : at + p.count]
        starts.append(at)
        at += p.count
    return tokens, labels, starts
