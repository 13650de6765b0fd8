"""ChunkFlow's pipeline schedule as data: what each stage computes in each slot, and a simulator that checks it.

A rank's step is its groups (``plan.Group``): a long sequence's dependent chunks, or one independent chunk. Chunk
``(g, j)`` is chunk j of group g. Every stage runs every chunk's forward ("F") and backward ("B") once, under:

(a) F (g, j) after F (g, j−1) on the same stage (chunk j reads the keys/values chunk j−1 wrote there);
(b) B (g, j) after B (g, j+1) on the same stage (it receives the gradients of its keys/values from the later
    chunks), and after its own F;
(c) at most K (``keep``) chunks of a group hold their activations on a stage: chunks j ≥ n − K keep their graphs
    from the forward, the earlier ones keep only their received input and run forward again inside their B slot;
(d) F on stage r after F on stage r − 1 (its input), B on stage r after B on stage r + 1 (its output gradient).

Time is counted in slots: a table is built with every op one slot long (``UNIT``; an op may take several, the
``cost`` argument). Both schedules below are a table ``slots[stage][t]`` of the ``("F"|"B", chunk)`` a stage
starts in slot t, or None; a transfer crosses the boundary after the slot that finished it, and the executor
(``state.run_schedule``) posts at boundary t exactly the sends and receives ``transfers(t)`` names, the same on
both ends of every link. ``simulate`` checks a table and measures it twice: idle slots of the table, and idle
time with each stage on its own clock (a backward twice a forward, a rerun one more forward: ``COST``) meeting
its neighbours at rendezvous transfers, as the executor runs. Simulated slots and clocks, not GPU time.

* ``gpipe_per_group``: the order before decision 1226: each long sequence's chunks all forwards then all backwards
  in reverse, filling and draining the pipeline on its own, then the single-chunk groups as 1F1B micro-batches.
* ``state_aware``: ChunkFlow's state-aware 1F1B. The long sequences run one after another per stage with the same
  order within each (so (a)-(c) hold), up to ``window`` of them in progress at once, and the independent chunks
  fill the slots where a stage would wait: each stage takes, slot by slot, a ready backward before a ready forward
  and the long sequence's op before an independent chunk's. A forward that keeps its graph starts only while stage
  r holds fewer than ``held_budget`` graphs: what one sequence's K chunks and 1F1B's own pp − r independent chunks
  hold, for any ``window`` (decision 1249). A held graph's backward needs no new graph on this stage (a sequence
  in its reruns keeps one unit for them), so the budget cannot deadlock; ``simulate`` checks it.

The executor posts a boundary's transfers one of two ways (``state.run_schedule``): as one batch that completes
when both ends posted it (a rendezvous: the sender waits for the receiver), or with sends that never wait
(``sends_wait=False`` in ``simulate``; decision 1249), where only a receive waits, for its data. The second lets a
table built with the ops' real proportions (``COST``) run as the greedy planned it.

Collider (decision 1223) needs on every stage a long group's kept positions, which the last stage chooses in the
group's forwards, before the group's first backward there. In any table that keeps (a), (b) and (d) they exist by
then: stage r's first backward of group g is B (g, n − 1), after the gradient of B (g, n − 1) on stage r + 1, ...,
after B (g, n − 1) on the last stage, after all of g's forwards there. So they cross each boundary with that
gradient (``Schedule.opens``), the same batch, and ``simulate`` checks they arrive before every backward of g.

Pure Python: no torch, no process group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megasparse.parallel.rendezvous import replay

ChunkId = tuple[int, int]
"""(group, chunk index in the group), the group's index in the rank's list."""
Op = tuple[str, ChunkId]
"""("F" | "B", chunk)."""


UNIT = (1, 1, 0)
"""(forward, backward, rerun) slots of a table whose transfers are rendezvous batches: one slot per op. Built with
``COST`` instead, the greedy table was up to 5% faster at pp 2 and up to 9% slower at pp 3-4 under ``COST``'s
clocks on a long-tail sample (decision 1226): a stage that finishes early still meets its peer at the boundary."""
COST = (1, 2, 1)
"""Times of a chunk's forward, its backward, and what a rerun adds to a backward (the forward again): B ≈ 2F, what
``simulate``'s clocks use by default, and the slots of a table whose sends never wait (decision 1249: 2-7% shorter
than the one-slot rendezvous table at pp 2-4 in the simulator, on the benchmark's long-tail steps)."""


@dataclass(frozen=True)
class Schedule:
    """Every stage's slots of one rank's step; the same table on every pipeline stage of a DP rank."""

    pp: int
    sizes: tuple[int, ...]
    """Chunks per group, in the rank's group order (1: an independent chunk)."""
    keep: int
    """K: chunks of one group that keep their activations on a stage."""
    slots: tuple[tuple[Op | None, ...], ...]
    """slots[stage][t]: the op the stage starts in slot t (None: idle, or still running an earlier op)."""
    cost: tuple[int, int, int] = UNIT
    """(forward, backward, rerun) slots of the table's ops."""

    @property
    def length(self) -> int:
        return len(self.slots[0])

    def kept(self, c: ChunkId) -> bool:
        """Whether chunk c keeps its graph from the forward (else it reruns before its backward)."""
        return c[1] >= self.sizes[c[0]] - self.keep

    def dur(self, op: Op) -> int:
        f, b, rerun = self.cost
        return f if op[0] == "F" else b + (0 if self.kept(op[1]) else rerun)

    def order(self, stage: int) -> list[Op]:
        return [op for op in self.slots[stage] if op is not None]

    def at(self, stage: int, t: int) -> Op | None:
        """The op stage ``stage`` starts in slot t."""
        return self.slots[stage][t] if 0 <= t < self.length and 0 <= stage < self.pp else None

    @functools.cached_property
    def _ends(self) -> list[dict[int, Op]]:
        return [{t + self.dur(op) - 1: op for t, op in enumerate(row) if op is not None} for row in self.slots]

    def ending(self, stage: int, t: int) -> Op | None:
        """The op stage ``stage`` finishes in slot t."""
        return self._ends[stage].get(t) if 0 <= stage < self.pp else None

    def transfers(self, stage: int, t: int) -> tuple[ChunkId | None, ChunkId | None, ChunkId | None, ChunkId | None]:
        """At boundary t (before slot t): (activation sent on, activation received, input gradient sent back,
        output gradient received), each the chunk it belongs to or None; what finished in slot t − 1 crosses."""
        mine, prev, nxt = self.ending(stage, t - 1), self.ending(stage - 1, t - 1), self.ending(stage + 1, t - 1)
        last, first = stage == self.pp - 1, stage == 0
        send_x = mine[1] if mine is not None and mine[0] == "F" and not last else None
        send_g = mine[1] if mine is not None and mine[0] == "B" and not first else None
        recv_x = prev[1] if prev is not None and prev[0] == "F" else None
        recv_g = nxt[1] if nxt is not None and nxt[0] == "B" else None
        return send_x, recv_x, send_g, recv_g

    def opens(self, c: ChunkId | None) -> bool:
        """Whether c is a long group's first backward on every stage (its last chunk): under collider its gradient
        crosses with the group's kept positions (``state.run_schedule``), which the last stage chose."""
        return c is not None and self.sizes[c[0]] > 1 and c[1] == self.sizes[c[0]] - 1


def _chunks(sizes: tuple[int, ...]) -> int:
    return sum(sizes)


def _rows(pp: int, starts: list[dict[int, Op]], length: int) -> tuple[tuple[Op | None, ...], ...]:
    return tuple(tuple(starts[r].get(t) for t in range(length)) for r in range(pp))


def timed(pp: int, sizes: tuple[int, ...], keep: int, orders: list[list[Op]], cost=UNIT) -> Schedule:
    """Start each stage's ``orders`` in the earliest slots their dependencies allow (one op at a time per stage)."""
    probe = Schedule(pp, sizes, keep, ((),) * pp, cost)
    end: dict[tuple[int, Op], int] = {}  # (stage, op) -> the slot after its last
    starts: list[dict[int, Op]] = [{} for _ in range(pp)]
    pos, free = [0] * pp, [0] * pp
    t = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        started = False
        for r in range(pp):
            op = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if op is None or free[r] > t or not _deps_done(end, r, op, pp, t):
                continue
            starts[r][t], pos[r], started = op, pos[r] + 1, True
            free[r] = t + probe.dur(op)
        if not started and all(f <= t for f in free):
            raise AssertionError(f"the orders wait on each other at slot {t} (pp={pp}, groups={sizes})")
        for r in range(pp):  # record ends only after every stage decided slot t
            if t in starts[r]:
                end[(r, starts[r][t])] = free[r]
        t += 1
    return Schedule(pp, sizes, keep, _rows(pp, starts, max(free)), cost)


def _deps_done(end: dict, r: int, op: Op, pp: int, t: int) -> bool:
    kind, (g, j) = op
    need = []
    if kind == "F":
        need += [(r - 1, op)] if r > 0 else []
        need += [(r, ("F", (g, j - 1)))] if j > 0 else []
    else:
        need += [(r, ("F", (g, j)))] + ([(r + 1, op)] if r < pp - 1 else [])
    return all(end.get(k, t + 1) <= t for k in need)


def gpipe_per_group(pp: int, sizes: tuple[int, ...], keep: int, cost=UNIT) -> Schedule:
    """The order before decision 1226 (``state.run_group`` per long sequence, then ``pipeline.one_f_one_b``)."""
    orders: list[list[Op]] = []
    singles = [(g, 0) for g, n in enumerate(sizes) if n == 1]
    for r in range(pp):
        order: list[Op] = []
        for g, n in enumerate(sizes):
            if n > 1:
                order += [("F", (g, j)) for j in range(n)] + [("B", (g, j)) for j in reversed(range(n))]
        warm = min(pp - r - 1, len(singles))
        order += [("F", c) for c in singles[:warm]]
        for i in range(len(singles) - warm):
            order += [("F", singles[warm + i]), ("B", singles[i])]
        order += [("B", c) for c in singles[len(singles) - warm :]]
        orders.append(order)
    return timed(pp, sizes, keep, orders, cost)


def held_budget(pp: int, r: int, keep: int, longest: int, singles: int) -> int:
    """Graphs stage r may hold at once under ``state_aware`` with sequences of up to ``longest`` chunks and
    ``singles`` independent chunks: the K of one sequence (its chunks if fewer; none without a long sequence) and
    1F1B's pp − r independent chunks (all of them if fewer), ``planner.chunks_held``'s count."""
    return (min(keep, longest) if longest > 1 else 0) + min(pp - r, singles)


def state_aware(pp: int, sizes: tuple[int, ...], keep: int, window: int = 1, cost=UNIT) -> Schedule:
    """ChunkFlow's state-aware 1F1B (module docstring), built slot by slot on all stages at once. ``window``: long
    sequences in progress on a stage at once (1: the next one starts after the previous one's last backward there;
    2: its forwards may fill the previous one's turnaround, holding both sequences' keys/values, within the same
    ``held_budget`` of graphs). ``cost``: the ops' slots (``UNIT`` for rendezvous transfers, ``COST`` for sends that
    never wait)."""
    probe = Schedule(pp, sizes, keep, ((),) * pp, cost)
    longs = [g for g, n in enumerate(sizes) if n > 1]
    singles = [(g, 0) for g, n in enumerate(sizes) if n == 1]
    budget = [held_budget(pp, r, keep, max(sizes, default=1), len(singles)) for r in range(pp)]
    held = [0] * pp  # graphs each stage holds (kept forwards not yet backward)
    fend: list[dict[ChunkId, int]] = [{} for _ in range(pp)]  # chunk -> the slot after its forward / backward
    bend: list[dict[ChunkId, int]] = [{} for _ in range(pp)]
    fseq, fj = [0] * pp, [0] * pp  # the long sequence (index into longs) forwarding on the stage, its next chunk
    bj = [dict() for _ in range(pp)]  # backwards started per long sequence in progress on the stage
    si, flight = [0] * pp, [[] for _ in range(pp)]  # next independent chunk to forward; those between F and B
    starts: list[dict[int, Op]] = [{} for _ in range(pp)]
    free = [0] * pp
    total = _chunks(sizes)

    def has_in(r: int, c: ChunkId, t: int) -> bool:  # the input arrived (its forward upstream has finished)
        return r == 0 or fend[r - 1].get(c, t + 1) <= t

    def has_grad(r: int, c: ChunkId, t: int) -> bool:  # the output gradient arrived
        return r == pp - 1 or bend[r + 1].get(c, t + 1) <= t

    def room(r: int) -> bool:
        """Whether a forward that keeps its graph fits the stage's budget. A sequence whose kept chunks have all run
        their backward keeps one unit for its reruns (a rerun's graph lives through its backward slot)."""
        reruns = sum(min(keep, sizes[longs[k]]) <= done < sizes[longs[k]] for k, done in bj[r].items())
        return held[r] + reruns < budget[r]

    def pick(r: int, t: int) -> Op | None:
        for k, done in sorted(bj[r].items()):  # backwards of the sequences forwarded here, oldest first
            c = (longs[k], sizes[longs[k]] - 1 - done)
            if k < fseq[r] and done < sizes[longs[k]] and has_grad(r, c, t):
                return "B", c
        ready = [c for c in flight[r] if has_grad(r, c, t)]
        if ready:
            return "B", ready[0]
        seq = longs[fseq[r]] if fseq[r] < len(longs) else None
        nxt = None if seq is None else (seq, fj[r])
        if nxt and (fj[r] or len(bj[r]) < window) and has_in(r, nxt, t) and (not probe.kept(nxt) or room(r)):
            return "F", nxt
        if si[r] < len(singles) and has_in(r, singles[si[r]], t) and room(r):
            return "F", singles[si[r]]
        return None

    t = 0
    while any(len(bend[r]) < total for r in range(pp)):
        picks = [pick(r, t) if free[r] <= t else None for r in range(pp)]  # on what finished before slot t
        if not any(picks) and all(f <= t for f in free):
            raise AssertionError(f"state-aware schedule stuck at slot {t} (pp={pp}, groups={sizes}, K={keep})")
        for r, op in enumerate(picks):
            if op is None:
                continue
            starts[r][t] = op
            free[r] = t + probe.dur(op)
            kind, c = op
            single = sizes[c[0]] == 1
            if probe.kept(c):
                held[r] += 1 if kind == "F" else -1
            if kind == "F":
                fend[r][c] = free[r]
                if single:
                    flight[r].append(c)
                    si[r] += 1
                else:
                    bj[r].setdefault(fseq[r], 0)
                    fj[r] += 1
                    if fj[r] == sizes[c[0]]:
                        fseq[r], fj[r] = fseq[r] + 1, 0
            else:
                bend[r][c] = free[r]
                if single:
                    flight[r].remove(c)
                else:
                    k = longs.index(c[0])
                    bj[r][k] += 1
                    if bj[r][k] == sizes[c[0]] and c[1] == 0:
                        del bj[r][k]
        t += 1
    return Schedule(pp, sizes, keep, _rows(pp, starts, max(free)), cost)


@dataclass
class Report:
    """What ``simulate`` measured: slots of the step, idle stage-slots (the bubble) and peak activations kept."""

    length: int
    idle: int
    peak_graphs: list[int]
    """Per stage: chunks holding their autograd graph at once (a rerun's graph counted in its B slot)."""
    time: float
    """The step's makespan with ``simulate``'s op times (the stages run asynchronously, meeting at transfers)."""
    idle_time: float
    """pp · time − the stages' busy time: the bubble in those units."""


def simulate(s: Schedule, times: tuple[float, float, float] = COST, sends_wait: bool = True) -> Report:
    """Run every stage's ops and boundary transfers as separate processes against each other.

    ``times``: (forward, backward, rerun) durations for the clocks each stage keeps (a batch completes when its
    last peer posted it, transfers take no time): ``Report.time``/``idle_time``. ``sends_wait=False``: a stage
    posts its sends and runs on; only its receives wait, for the peer's send (the executor's sends on their own
    streams, decision 1249).
    ``length``/``idle`` count the table's slots.

    Each boundary's sends and receives are posted as one batch (``StageComm.send_recv``, as the executor posts
    them) that completes when every peer has posted the matching op (rendezvous, as gloo and NCCL behave): a stage
    with nothing at a boundary posts nothing and runs on. Raises AssertionError when a link's two ends disagree on
    what crosses, in what order (a long group's kept positions, collider's, cross with its first backward's
    gradient: ``Schedule.opens``); a forward or backward finds its input, output gradient or own forward missing;
    (a)-(c) are broken; two long sequences' backwards interleave on a stage (the planner counts one sequence's K/V
    gradient buffers); a chunk is not run exactly once forward and once backward per stage; or the stages
    deadlock."""
    P, T = s.pp, s.length
    total = _chunks(s.sizes)
    streams: list[list] = []
    for r in range(P):
        ev: list = []
        for t in range(T + 1):
            sx, rx, sg, rg = s.transfers(r, t)
            batch = []
            batch += [("send", (r, r + 1), ("act", sx))] if sx is not None else []
            batch += [("recv", (r - 1, r), ("act", rx))] if rx is not None else []
            batch += [("send", (r, r - 1), ("grad", sg))] if sg is not None else []
            batch += [("send", (r, r - 1), ("kept", sg[0]))] if s.opens(sg) else []
            batch += [("recv", (r + 1, r), ("grad", rg))] if rg is not None else []
            batch += [("recv", (r + 1, r), ("kept", rg[0]))] if s.opens(rg) else []
            if batch:
                ev.append(batch)
            if t < T and s.slots[r][t] is not None:
                ev.append(s.slots[r][t])
        streams.append(ev)
    fdone: list[set] = [set() for _ in range(P)]
    bdone: list[set] = [set() for _ in range(P)]
    backing: list[set] = [set() for _ in range(P)]  # long groups whose backwards run on the stage (one at a time)
    graphs = [0] * P
    seq_graphs: list[dict[int, int]] = [{} for _ in range(P)]
    peak = [0] * P
    t_f, t_b, t_rerun = times

    def compute(r: int, op: Op, have: set) -> float:
        _check_op(s, r, op, have, fdone[r], bdone[r])
        kind, c = op
        g = c[0]
        if kind == "F":
            fdone[r].add(c)
            if s.kept(c):
                graphs[r] += 1
                seq_graphs[r][g] = seq_graphs[r].get(g, 0) + 1
        else:
            bdone[r].add(c)
            if s.sizes[g] > 1:  # its K/V gradient buffers live from its first backward to its last (decision 1249)
                backing[r].add(g)
                assert len(backing[r]) == 1, f"stage {r}: two sequences' backwards interleave at {op}"
                if c[1] == 0:
                    backing[r].discard(g)
            held = 0 if s.kept(c) else 1  # a rerun's graph lives through its B slot
            peak[r] = max(peak[r], graphs[r] + held)
            assert seq_graphs[r].get(g, 0) + held <= s.keep, f"stage {r}: group {g} holds more than K"
            if s.kept(c):
                graphs[r] -= 1
                seq_graphs[r][g] -= 1
        peak[r] = max(peak[r], graphs[r])
        assert max(seq_graphs[r].values(), default=0) <= s.keep, f"stage {r}: K broken at {op}"
        return t_f if kind == "F" else t_b + (0.0 if s.kept(c) else t_rerun)

    clock, busy = replay(streams, compute, f"pp={P}, groups={s.sizes}, K={s.keep}", sends_wait)
    for r in range(P):
        assert len(fdone[r]) == len(bdone[r]) == total == len(s.order(r)) / 2, f"stage {r} misses chunks"
    makespan = max(clock)
    work = sum(s.dur(op) for r in range(P) for op in s.order(r))
    return Report(T, P * T - work, peak, makespan, P * makespan - sum(busy))


def _check_op(s: Schedule, r: int, op: Op, have: set, fdone: set, bdone: set) -> None:
    kind, c = op
    g, j = c
    if kind == "F":
        assert c not in fdone, f"stage {r}: F{c} twice"
        assert r == 0 or ("act", c) in have, f"stage {r}: F{c} before its input arrived"
        assert j == 0 or (g, j - 1) in fdone, f"stage {r}: F{c} before F{(g, j - 1)}"
    else:
        assert c not in bdone and c in fdone, f"stage {r}: B{c} twice or before its F"
        assert r == s.pp - 1 or ("grad", c) in have, f"stage {r}: B{c} before its output gradient arrived"
        assert r == s.pp - 1 or s.sizes[g] == 1 or ("kept", g) in have, f"stage {r}: B{c} before its kept positions"
        assert j == s.sizes[g] - 1 or (g, j + 1) in bdone, f"stage {r}: B{c} before B{(g, j + 1)}"
