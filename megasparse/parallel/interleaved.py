"""Megatron's interleaved 1F1B schedule as data: what one pipeline rank computes and sends, in order.

With ``parallel.virtual_stages`` = v each of the P pipeline ranks holds v model chunks; chunk c of rank r is
virtual stage c·P + r, so activations go round the ring v times (rank P−1's chunk c feeds rank 0's chunk c+1)
and gradients come back the same way. The M micro-batches run in groups of P: virtual micro-batch k is
micro-batch (k // (P·v))·P + k % P on chunk (k % (P·v)) // P in the forward order, and on the mirrored chunk
v − 1 − that in the backward order. Rank r runs (P − r − 1)·2 + (v − 1)·P warm-up forwards, then one forward
and one backward per step, then the remaining backwards. With chunk times a v-th of a stage's, the bubble
shrinks from (P − 1)/(M + P − 1) to (P − 1)/(v·M + P − 1) of the step (``simulate`` checks it).

``plan`` lists the steps; ``pipeline.interleaved_1f1b`` executes them. Each ``Comm`` is one batch of P2P ops
posted together (Megatron's ``send_forward_backward_recv_forward_backward``): the receive flags are Megatron's,
which pair every receive with the neighbour's send in the same order on every channel. Each op names the
(chunk, micro-batch) it is for, so the executor files what arrives under its key and nothing else travels.
With P = 2 both neighbours are one rank and activations and gradients share one channel; ``simulate`` checks
that both ends see them in the same order, and that no rank waits forever, for every layout the tests list.
This module is pure Python: no torch, no process group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megasparse.parallel.rendezvous import replay

Key = tuple[int, int]
"""(chunk, micro-batch)."""


@dataclass(frozen=True)
class Comm:
    """One batch of P2P ops; each field is the local (chunk, micro-batch) it concerns, None: no such op."""

    send_fwd: Key | None = None
    """The forward whose output goes to the next rank."""
    recv_fwd: Key | None = None
    """The forward whose input arrives from the previous rank."""
    send_bwd: Key | None = None
    """The backward whose input gradient goes to the previous rank."""
    recv_bwd: Key | None = None
    """The backward whose output gradient arrives from the next rank."""


@dataclass(frozen=True)
class Compute:
    kind: str
    """"F" (forward) or "B" (backward)."""
    chunk: int
    mb: int


Step = Compute | Comm


def warmup_forwards(pp: int, rank: int, chunks: int, num_mb: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron's count, capped at all of them)."""
    return min((pp - rank - 1) * 2 + (chunks - 1) * pp, num_mb * chunks)


@functools.cache
def plan(pp: int, rank: int, chunks: int, num_mb: int) -> tuple[Step, ...]:
    """Rank ``rank``'s steps of one optimizer step of interleaved 1F1B (``num_mb`` a multiple of ``pp``). Pure and
    fixed for a run, so cached: the trainer asks for it every optimizer step."""
    P, r, v = pp, rank, chunks
    if num_mb % P:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({num_mb}) to be a multiple of pp={P}")
    total = num_mb * v

    def fwd(k: int) -> Key:
        group, j = divmod(k, P * v)
        return j // P, group * P + j % P

    def bwd(k: int) -> Key:
        c, i = fwd(k)
        return v - 1 - c, i

    def first(c: int) -> bool:  # virtual stage 0: the embedding, no input to receive
        return r == 0 and c == 0

    def last(c: int) -> bool:  # the last virtual stage: the loss, no output to send
        return r == P - 1 and c == v - 1

    # what arrives, in arrival order on each channel: the inputs / output gradients this rank needs, in its order
    inputs = iter([fwd(k) for k in range(total) if not first(fwd(k)[0])])
    grads = iter([bwd(k) for k in range(total) if not last(bwd(k)[0])])
    steps: list[Step] = []

    def comm(send_fwd: Key | None, recv_fwd: bool, send_bwd: Key | None, recv_bwd: bool) -> None:
        c = Comm(send_fwd, next(inputs) if recv_fwd else None, send_bwd, next(grads) if recv_bwd else None)
        if c != Comm():
            steps.append(c)

    def forward(k: int) -> Key | None:
        c, i = fwd(k)
        steps.append(Compute("F", c, i))
        return None if last(c) else (c, i)

    def backward(k: int) -> Key | None:
        c, i = bwd(k)
        steps.append(Compute("B", c, i))
        return None if first(c) else (c, i)

    warm = warmup_forwards(P, r, v, num_mb)
    steady = total - warm
    comm(None, not first(fwd(0)[0]), None, False)
    for k in range(warm):
        out = forward(k)
        recv = k + 1 < total and not first(fwd(k + 1)[0])
        comm(out, recv, None, k == warm - 1 and steady > 0 and r != P - 1)
    for k in range(steady):
        fk = warm + k
        out = forward(fk)
        gin = backward(k)
        # rank 0 receives what rank P−1 sends in the same exchange: the output of its forward fk − (P − 1)
        recv_f = k < steady - 1 and (r != 0 or fwd(fk - (P - 1))[0] != v - 1)
        # rank P−1 receives what rank 0 sends: the input gradient of its backward k − (P − 1)
        recv_b = r != P - 1 or bwd(k - (P - 1))[0] != 0
        comm(out, recv_f, gin, recv_b)
    if steady == 0:
        comm(None, False, None, not last(bwd(0)[0]))
    for k in range(steady, total):
        gin = backward(k)
        recv = k + 1 < total and not last(bwd(k + 1)[0])
        comm(None, False, gin, recv)
    return tuple(steps)


def simulate(
    pp: int, chunks: int, num_mb: int, t_f: float = 1.0, t_b: float = 2.0, two_phase: bool = False
) -> tuple[float, list[float]]:
    """Run every rank's ``plan`` against each other: (makespan, per-rank busy time) with unit-free chunk times.

    Transfers are rendezvous (a send completes when its receive is posted, as NCCL and gloo behave for these
    sizes) and take no time. Raises AssertionError when a channel's sends and receives disagree on order, a
    compute finds its input missing, or the ranks deadlock. ``two_phase``: compact gradients whose row count
    only the indices tell: their rows are sent and received in a second batch after the indices
    (``StageComm.send_recv``'s unbalanced case; receiving only them later would deadlock round the ring).
    ``t_f``/``t_b`` are one chunk's forward/backward time.
    """
    P = pp
    plans = [plan(P, r, chunks, num_mb) for r in range(P)]
    # expand each Comm into batches of (kind, channel, label) ops; forward-direction ops first, like the executor
    batches: list[list] = []
    for r, steps in enumerate(plans):
        nxt, prv = (r + 1) % P, (r - 1) % P
        out: list = []
        for st in steps:
            if isinstance(st, Compute):
                out.append(st)
                continue
            ops, later = [], []
            if st.send_fwd is not None:
                c, i = st.send_fwd
                ops.append(("send", (r, nxt), ("act", c + (r == P - 1), i)))
            if st.recv_fwd is not None:
                ops.append(("recv", (prv, r), ("act",) + st.recv_fwd))
            if st.send_bwd is not None:
                c, i = st.send_bwd
                key = (c - (r == 0), i)
                ops.append(("send", (r, prv), ("idx",) + key))
                (later if two_phase else ops).append(("send", (r, prv), ("rows",) + key))
            if st.recv_bwd is not None:
                ops.append(("recv", (nxt, r), ("idx",) + st.recv_bwd))
                (later if two_phase else ops).append(("recv", (nxt, r), ("rows",) + st.recv_bwd))
            out += [ops] + ([later] if later else [])
        batches.append(out)

    def compute(r: int, st: Compute, have: set) -> float:
        key = (st.chunk, st.mb)
        if st.kind == "F" and not (r == 0 and st.chunk == 0):
            assert ("act",) + key in have, f"rank {r}: F{key} before its input arrived"
        if st.kind == "B" and not (r == P - 1 and st.chunk == chunks - 1):
            assert ("rows",) + key in have, f"rank {r}: B{key} before its gradient arrived"
        return t_f if st.kind == "F" else t_b

    clock, busy = replay(batches, compute, f"pp={P}, chunks={chunks}, micro-batches={num_mb}")
    return max(clock), busy


def bubble_fraction(pp: int, chunks: int, num_mb: int) -> float:
    """Idle share of a step with equal stages and free transfers: (P − 1)/(v·M + P − 1) (Narayanan et al.)."""
    return (pp - 1) / (chunks * num_mb + pp - 1)
