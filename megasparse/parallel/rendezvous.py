"""Simulated blocking transfers for the pipeline-schedule simulators (``interleaved.simulate``,
``chunkflow/schedule.simulate``): a rank posts a batch of sends and receives, and the batch completes once every
peer has posted its side. Both ends must name the same label in the same order on each link; the batch finishes at
the latest of the ranks' clocks. Pure Python, no torch.distributed."""

from __future__ import annotations

__all__ = ["Links"]

_OTHER = {"send": "recv", "recv": "send"}


class Links:
    """Every link's posted sends and receives, in order: ``{channel: {"send": [(time, label)], "recv": [...]}}``."""

    def __init__(self) -> None:
        self.posted: dict[tuple, dict[str, list]] = {}
        self._waiting: dict[int, list] = {}  # rank -> its posted batch's (kind, channel, index)

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
        mine = self._waiting[rank]
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
