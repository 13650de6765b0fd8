"""Every output-layer loss: Cut Cross-Entropy (``impl=cce``), materialised logits (``impl=materialized``),
megatron-core's own materialised cross-entropy (``impl=mcore``, the unmodified baseline), chosen per run by
``impl=auto``, and the pipeline-sliced loss (``pipeline.py``, ``loss.vocab_over_pp``).

Layout: ``core.py`` (the one loss skeleton, ``KeepSpec``, ``LossOptions``), ``function.py`` (the TP autograd
Function), ``cce_kernels.py`` (Triton), ``cce_launch.py`` (launchers, backend dispatch), ``reference.py`` (chunked
torch maths, ``backend=reference``), ``materialized.py`` (whole-logit maths), ``rows.py`` (row helpers),
``mcore.py``, ``pipeline.py``.
Collectives live in ``megasparse/parallel`` (``vocab.py``, ``vocab_pp_comm.py``); nothing there imports this package.
"""

from __future__ import annotations

import logging
import os
from functools import cache

import torch
from torch import Tensor

from megasparse.loss.cce_launch import KernelConfig, shard_backward, shard_forward, vocab_order
from megasparse.loss.config import LossConfig, resolve_impl
from megasparse.loss.core import KeepSpec, LossOptions, loss_options
from megasparse.loss.function import VocabParallelLoss
from megasparse.loss.speed import timed_choice
from megasparse.ops.compact import KeepHolder

__all__ = [
    "AUTO_CHOICES", "KeepSpec", "KernelConfig", "LossConfig", "LossOptions", "loss_options", "resolve_impl",
    "shard_backward", "shard_forward", "vocab_order", "vocab_parallel_loss",
]  # fmt: skip

log = logging.getLogger(__name__)

AUTO_CHOICES: list[str] = []
"""Each distinct impl=auto decision of this process, in order, on every rank: benchmarks store them beside their
numbers, so a table's claim about which loss auto ran can be checked."""


@cache
def _log_choice(reason: str) -> None:
    """Say each distinct impl=auto decision once per process (the shapes of a run are fixed), on the first rank's
    console like the trainer's other one-time choices (the 2:4 autotune's), and to the logger."""
    AUTO_CHOICES.append(reason)
    log.info(reason)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(reason, flush=True)


def vocab_parallel_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    cfg: LossConfig,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group=None,
    sequence_parallel: bool = False,
    keep_idx: KeepSpec | KeepHolder | Tensor | None = None,
    ignore_index: int = -100,
    operand: Tensor | None = None,
) -> Tensor:
    """Per-token loss [n] fp32 over all rows of the TP region; gradients flow to ``hidden`` and ``weight``.

    ``hidden`` is [n/tp, h] under sequence parallelism (its dE comes back reduce-scattered), else [n, h].
    ``weight`` is this rank's [V_local, h] shard starting at ``vocab_start``; rows past ``vocab_size``
    are padding and never count. Rows with ``ignore_index`` get loss 0 and no gradient; ``keep_idx``
    (a ``KeepSpec``, or what ``KeepSpec.of`` takes) names the rows that get one (all rows still get a loss).
    ``operand``: ``weight``'s compute-dtype copy, made once per optimizer step (decision 0009); ``weight`` is then
    the fp32 master and its gradient is added into its bucket slice by the loss's own dC GEMMs.
    """
    n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    targets = targets.reshape(-1)
    keep = KeepSpec.of(keep_idx)
    impl, reason = resolve_impl(cfg, targets.numel(), weight.shape[0])
    if cfg.impl == "auto" and impl == "materialized" and cfg.speed_check and hidden.is_cuda and torch.is_grad_enabled():
        dt = hidden.dtype
        rows, width, d = targets.numel(), weight.shape[0], hidden.shape[-1]
        impl, reason = timed_choice(cfg, rows, width, d, dt, hidden.device, n_valid, tp_group, (impl, reason))
    if cfg.impl == "auto":
        _log_choice(reason)
    if impl == "mcore":  # dense backward: a KeepHolder is ignored (config validation rejects collider)
        from megasparse.loss.mcore import mcore_vocab_parallel_loss

        if keep.idx is not None:
            raise ValueError("loss.impl=mcore has a dense backward: keep_idx is not supported")
        w = weight if operand is None else weight.to(operand.dtype)  # megatron's loss: autograd's weight gradient
        return mcore_vocab_parallel_loss(
            hidden, w, targets, n_valid=n_valid, group=tp_group, sequence_parallel=sequence_parallel,
            ignore_index=ignore_index,
        )  # fmt: skip
    opt = loss_options(cfg, impl, hidden.dtype, n_valid, vocab_start, ignore_index, sequence_parallel)
    return VocabParallelLoss.apply(hidden, weight, targets, keep, tp_group, opt, operand)
