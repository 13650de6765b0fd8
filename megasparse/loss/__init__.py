"""Vocabulary-parallel output loss: Cut Cross-Entropy (``impl=cce``), materialised logits (``impl=torch``), or
megatron-core's own materialised cross-entropy (``impl=mcore``, the unmodified baseline).

``vocab_parallel_loss`` is what the trainer calls. The per-slice pieces (``shard_forward`` /
``shard_backward``) are exported for callers that split the vocabulary further (pipeline ranks).
"""

from __future__ import annotations

from torch import Tensor

from megasparse.loss.cce import CCEOptions, KernelConfig, VocabParallelCCE, shard_backward, shard_forward, vocab_order
from megasparse.loss.config import LossConfig
from megasparse.loss.materialized import materialized_loss

__all__ = ["LossConfig", "KernelConfig", "shard_backward", "shard_forward", "vocab_order", "vocab_parallel_loss"]


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
    keep_idx: Tensor | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Per-token loss [n] fp32 over all rows of the TP region; gradients flow to ``hidden`` and ``weight``.

    ``hidden`` is [n/tp, h] under sequence parallelism (its dE comes back reduce-scattered), else [n, h].
    ``weight`` is this rank's [V_local, h] shard starting at ``vocab_start``; rows past ``vocab_size``
    are padding and never count. Rows with ``ignore_index`` get loss 0 and no gradient; with
    ``keep_idx`` only those rows get a gradient (all rows still get a loss).
    """
    n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    targets = targets.reshape(-1)
    if cfg.impl == "mcore":  # dense backward: a KeepHolder is ignored (config validation rejects collider)
        from megasparse.parallel.mcore_ce import mcore_vocab_parallel_loss

        if isinstance(keep_idx, Tensor):
            raise ValueError("loss.impl=mcore has a dense backward: keep_idx is not supported")
        return mcore_vocab_parallel_loss(
            hidden, weight, targets, n_valid=n_valid, group=tp_group, sequence_parallel=sequence_parallel,
            ignore_index=ignore_index,
        )  # fmt: skip
    if cfg.impl == "torch":
        return materialized_loss(
            hidden, weight, targets, vocab_start=vocab_start, n_valid=n_valid, softcap=cfg.softcap,
            z_loss=cfg.z_loss, group=tp_group, sequence_parallel=sequence_parallel, keep_idx=keep_idx,
            ignore_index=ignore_index,
        )  # fmt: skip
    opt = CCEOptions(
        n_valid=n_valid, vocab_start=vocab_start, softcap=cfg.softcap, z_loss=cfg.z_loss,
        filter_eps=cfg.filter_eps, sort_vocab=cfg.sort_vocab, accum_fp32=cfg.grad_accum_fp32,
        ignore_index=ignore_index, sequence_parallel=sequence_parallel, backend=cfg.backend,
    )  # fmt: skip
    return VocabParallelCCE.apply(hidden, weight, targets, keep_idx, tp_group, opt)
