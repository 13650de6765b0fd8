"""One-line token filtering for custom training loops (in the spirit of Collider's ``backward_filter``).

    holder = KeepHolder()
    per_token = model(ids, targets, holder)            # a megasparse GPTStage (last stage), loss per token [s·b]
    keep = select_tokens(scores, 0.6, "sequence").mask  # or any bool mask [s, b]
    backward_filter(per_token, keep, holder)            # masked loss; backward on kept rows only

The forward stays dense; ``backward_filter`` tells the loss layer which rows survive, so every op's backward,
every TP/SP collective and the pipeline send below it work on the kept rows alone.
"""

from __future__ import annotations

import torch

from megasparse.ops.compact import KeepHolder, KeepMeta

__all__ = ["KeepHolder", "backward_filter"]


def backward_filter(
    per_token_loss: torch.Tensor,
    keep: torch.Tensor,
    holder: KeepHolder,
    normaliser: float | None = None,
    dimension_reduced: bool = True,
) -> torch.Tensor:
    """Backward of sum(loss·keep)/normaliser (default: kept count); returns that scalar loss.

    ``keep`` is a bool mask shaped like the model's [s, b] tokens. ``dimension_reduced=False`` gives the Rho-1
    baseline (same loss, dense backward).
    """
    mask = keep.reshape(-1).to(per_token_loss.device)
    if mask.numel() != per_token_loss.numel():
        raise ValueError(f"keep mask has {mask.numel()} entries, the loss {per_token_loss.numel()}")
    idx = mask.nonzero(as_tuple=True)[0]
    if dimension_reduced:
        batch = keep.shape[1] if keep.dim() == 2 else 1
        holder.meta = KeepMeta(idx, per_token_loss.numel(), batch)
    loss = (per_token_loss * mask).sum() / (normaliser if normaliser is not None else max(idx.numel(), 1))
    loss.backward()
    return loss.detach()
