"""How a step's micro-batches are ordered on this rank: ``get_schedule(cfg, train)``.

Every schedule has one signature, ``schedule(num_mb, p2p, step, in_flight, slot)``:

* ``step``: the ``MicrobatchStep`` whose ``forward`` / ``backward`` run one micro-batch;
* ``in_flight``: what runs a micro-batch between its forward and backward (``pipeline.InFlight`` eagerly, or a
  CUDA-graph executor's replayed graphs), from ``step/executor.py``; None: the eager default;
* ``slot``: a per-micro-batch hook the schedule calls at its fixed place (the vocabulary-over-PP peers' slices of
  the loss), or None.

The schedules themselves (the P2P order) live in ``parallel/pipeline.py`` with the transfers they order; this
module picks one and adapts it to the signature, so the trainer never branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megasparse.parallel.pipeline import StageComm, forward_only, interleaved_1f1b, lockstep, one_f_one_b

__all__ = ["Schedule", "get_schedule"]

Slot = Callable[[int], None]


class Schedule(Protocol):
    name: str

    def __call__(self, num_mb: int, p2p: StageComm, step, in_flight=None, slot: Slot | None = None) -> None: ...


class OneFOneB:
    """Plain 1F1B (pp = 1 included: forward then backward per micro-batch); graphs may replay inside it."""

    name = "1f1b"

    def __call__(self, num_mb: int, p2p: StageComm, step, in_flight=None, slot: Slot | None = None) -> None:
        assert slot is None, "1F1B has no per-micro-batch slot (the vocabulary over PP runs lock-step)"
        one_f_one_b(num_mb, p2p, step.forward, step.backward, in_flight)


class Interleaved:
    """Megatron's interleaved 1F1B over this rank's virtual-stage chunks (eager: ``parallel.virtual_stages``)."""

    name = "interleaved"

    def __call__(self, num_mb: int, p2p: StageComm, step, in_flight=None, slot: Slot | None = None) -> None:
        assert slot is None, "the interleaved schedule has no per-micro-batch slot"
        interleaved_1f1b(num_mb, p2p, step.forward, step.backward, in_flight)


class LockStep:
    """Every stage forwards, joins micro-batch k's vocabulary slot, then backwards in one period (decision 0800)."""

    name = "lockstep"

    def __call__(self, num_mb: int, p2p: StageComm, step, in_flight=None, slot: Slot | None = None) -> None:
        lockstep(num_mb, p2p, step.forward, step.backward, slot, in_flight)


class ForwardOnly:
    """Evaluation: each micro-batch through every chunk, then ``slot(i)``; no backward, no graphs."""

    name = "forward-only"

    def __call__(self, num_mb: int, p2p: StageComm, step, in_flight=None, slot: Slot | None = None) -> None:
        assert in_flight is None, "evaluation runs eagerly"
        with torch.no_grad():
            forward_only(num_mb, p2p, step.forward, slot)


def get_schedule(cfg, train: bool) -> Schedule:
    """The schedule a run's config implies: evaluation is forward-only; ``loss.vocab_over_pp`` runs lock-step (the
    output layer's slices meet once per micro-batch); ``parallel.virtual_stages`` > 1 the interleaved 1F1B;
    everything else plain 1F1B."""
    if not train:
        return ForwardOnly()
    if cfg.loss.vocab_over_pp and cfg.parallel.pp > 1:
        return LockStep()
    if cfg.parallel.virtual_stages > 1:
        return Interleaved()
    return OneFOneB()
