"""megatron-core's own vocabulary-parallel cross-entropy as a trainer loss (``loss.impl: mcore``).

The unmodified baseline: bf16 logits of this rank's vocabulary shard, cast to fp32, into
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (three [n] all-reduces over TP: max, sum of
exps, target logit). It materialises [n, V_local] logits and its backward is dense, so it takes no
filtered-token compaction, softcap or z-loss (config validation says so). Two adaptations keep it the same
model as ``cce``/``torch``: padded vocabulary columns are masked to -inf (megatron would train them as
tokens), and ignore_index rows get loss 0. The hidden states enter the TP region as in megatron's output
layer (``vocab.GatherRows``: all-gather under SP, identity otherwise; reduce-scatter or all-reduce of dE in
backward, recorded by ``megasparse.parallel.comm``). The three loss all-reduces run inside megatron-core on its
TP group, which ``megasparse.parallel.state`` made the trainer's, and are not recorded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.parallel import vocab


def mcore_vocab_parallel_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    n_valid: int,
    group=None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
) -> Tensor:
    """Per-token loss [n] fp32. ``hidden`` [n(/tp), h] or [s(/tp), b, h]; ``weight`` this TP rank's shard."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    h = vocab.GatherRows.apply(hidden.reshape(-1, hidden.shape[-1]), group, sequence_parallel)
    logits = (h @ weight.t()).float()
    if n_valid < weight.shape[0]:
        pad = torch.arange(weight.shape[0], device=weight.device) >= n_valid
        logits = logits.masked_fill(pad, float("-inf"))
    targets = targets.reshape(-1)
    loss = vocab_parallel_cross_entropy(logits, targets)
    return torch.where(targets != ignore_index, loss, torch.zeros_like(loss))
