"""Simulated blocking transfers for the pipeline-schedule simulators (``interleaved.simulate``,
``chunkflow/schedule.simulate``): a rank posts a batch of sends and receives, and the batch completes once every
peer has posted its side. Both ends must name the same label in the same order on each link; the batch finishes at
the latest of the ranks' clocks. ``replay`` runs every rank's stream of compute ops and transfer batches against the
others. Pure Python, no torch.distributed."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Links", "replay"]

_OTHER = {"send": "recv", "recv": "send"}


class Links:
    """Every link's posted sends and receives, in order: ``{channel: {"send": [(time, label)], "recv": [...]}}``.
    ``sends_wait=False``: a send completes when posted (the sender runs on), a receive when its send is posted."""

    def __init__(self, sends_wait: bool = True) -> None:
        self.posted: dict[tuple, dict[str, list]] = {}
        self._waiting: dict[int, list] = {}  # rank -> its posted batch's (kind, channel, index)
        self.sends_wait = sends_wait

    def meet(self, rank: int, batch: list, clock: float) -> tuple[float, list] | None:
        """Post ``rank``'s ``batch`` of ``(kind, channel, label)`` once (at ``clock``); None while a peer has not
        posted its side yet, else (the time the batch completes, the labels received)."""
        if rank not in self._waiting:
            mine = []
            for kind, ch, label in batch:
                lst = self.posted.setdefault(ch, {"send": [], "recv": []})[kind]
                lst.append((clock, label))
                mine.append((kind, ch, len(lst) - 1))
            self._waiting[rank] = mine
        mine = [m for m in self._waiting[rank] if self.sends_wait or m[0] == "recv"]  # the receiver checks labels
        if any(len(self.posted[ch][_OTHER[kind]]) <= n for kind, ch, n in mine):
            return None
        done, received = clock, []
        for kind, ch, n in mine:
            (t_me, label), (t_peer, theirs) = self.posted[ch][kind][n], self.posted[ch][_OTHER[kind]][n]
            assert label == theirs, f"link {ch}: {kind} {label} met {theirs}"
            done = max(done, t_me, t_peer)
            if kind == "recv":
                received.append(label)
        del self._waiting[rank]
        return done, received


def replay(
    streams: list[list], compute: Callable[[int, object, set], float], what: str, sends_wait: bool = True
) -> tuple[list[float], list[float]]:
    """Each rank's stream run against the others: (clock, busy time) per rank. An event that is a list is a batch of
    ``(kind, channel, label)`` transfers (``Links.meet``: the rank waits until every peer posted its side, or with
    ``sends_wait=False`` only its receives' senders); any other event is a compute op, ``compute(rank, op, labels
    received so far)`` checks it and returns its duration. Raises AssertionError when the ranks deadlock (``what``
    names the schedule in the message)."""
    ranks = len(streams)
    links, pos = Links(sends_wait), [0] * ranks
    clock, busy = [0.0] * ranks, [0.0] * ranks
    have: list[set] = [set() for _ in range(ranks)]
    moved = True
    while moved:
        moved = False
        for r in range(ranks):
            while pos[r] < len(streams[r]):
                ev = streams[r][pos[r]]
                if isinstance(ev, list):
                    got = links.meet(r, ev, clock[r])
                    if got is None:
                        break  # a peer has not posted its side yet
                    clock[r], received = got
                    have[r].update(received)
                else:
                    dt = compute(r, ev, have[r])
                    clock[r] += dt
                    busy[r] += dt
                pos[r] += 1
                moved = True
    stuck = [r for r in range(ranks) if pos[r] < len(streams[r])]
    assert not stuck, f"deadlock: ranks {stuck} wait ({what})"
    return clock, busy
