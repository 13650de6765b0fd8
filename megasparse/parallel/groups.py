"""The process groups a layer talks over, handed to it at construction (as megatron-core's ``pg_collection``).

Why: a layer that reads the global layout inside its autograd Function works only for the one layout the process
set up; a reference model, a test or a second model in the same process would silently share it. ``ProcessGroups``
is a value: the trainer's comes from ``parallel/state.py`` (``state.groups()``), and the layers below
(``parallel/layers.py``, ``parallel/vocab.py``, ``ops/``) read nothing else. ``tests/test_architecture.py`` checks
that they do not import ``state``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's tensor-parallel group with its size and rank (the pipeline and data groups stay with the trainer
    and the schedules, which get them from ``state``)."""

    tp_group: object | None = None
    """The torch.distributed TP group (None: no process group, a single rank)."""
    tp: int = 1
    """TP group size."""
    tp_rank: int = 0
    """This rank's place in the TP group."""

    def __post_init__(self) -> None:
        if self.tp > 1 and self.tp_group is None:
            raise ValueError(f"ProcessGroups(tp={self.tp}) needs its tp_group")
        if not 0 <= self.tp_rank < self.tp:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp={self.tp}")


SINGLE = ProcessGroups()
"""One rank, no collectives: what a layer built outside any process group gets."""
