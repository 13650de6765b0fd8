"""Collectives of the pipeline-sliced output loss (``loss/pipeline.py``), all through ``comm``.

The last stage broadcasts its hidden rows, the per-token loss gradient and (collider) the kept rows over PP;
every (pp, tp) rank's slice statistics are merged with ONE all-gather of [2, n] over the model-parallel group;
the slices' partial dE are summed over that group. Plain functions: the loss decides when, these say how.
"""

from __future__ import annotations

from torch import Tensor

from megasparse.parallel import comm, state, vocab

REGION = "loss.vocab_pp"


def broadcast_from_last(t: Tensor) -> None:
    """In place: the last pipeline stage's ``t`` on every stage."""
    comm.broadcast(t, state.pp_last_rank(), state.pp_group(), "pp", region=REGION)


def gather_tp_rows(h: Tensor) -> Tensor:
    """The last stage's sequence shards (SP) gathered over TP: every rank of the stage holds all rows."""
    return comm.all_gather(h, state.tp_group(), "tp", dim=0, region=REGION)


def merge_slice_stats(lse: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token (lse, target logit) over every slice of the model-parallel group, identical on every rank."""
    return vocab.merge_shard_stats(lse, tgt, state.mp_group(), "mp", REGION)


def sum_slice_dgrad(d_e: Tensor) -> None:
    """In place: the slices' partial dE summed over the model-parallel group."""
    comm.all_reduce(d_e, state.mp_group(), "mp", region=REGION)
