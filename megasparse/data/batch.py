"""One micro-batch as it flows through the trainer: tokens plus what aligns per-token side data with them.

Every pipeline stage and data-parallel rank reads its own micro-batches from the same deterministic stream
(``data/dataset.py``'s :func:`~megasparse.data.dataset.iterate_batches`), so the stage that selects tokens holds
the sample ids and ``.bin`` offsets of exactly the tokens it scores; under SP every TP rank holds the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch"]


@dataclass
class Batch:
    """``tokens`` [b, s+1]; ``labels`` are ``tokens[:, 1:]``. Properties return megatron's [s, b] layout."""

    tokens: torch.Tensor
    """int64 [b, s+1]: the micro-batch's samples, inputs ``[:, :-1]`` and labels ``[:, 1:]``."""
    samples: torch.Tensor
    """int64 [b]: global sample index of each row in the endless training stream (for logs and tests)."""
    positions: torch.Tensor | None = None
    """int64 [b, s+1]: ``.bin`` offset of each token (-1: an EOD the packer inserted); None for synthetic data.
    For a blend, offsets into the corpora's ``.bin`` files one after another (``BlendedDataset.offsets``).
    A reference-loss sidecar is gathered at the labels' offsets (``label_positions``)."""

    def to(self, device: torch.device, pin: bool = False) -> Batch:
        """Tokens on the compute device; sample ids and offsets stay on the host (they index host arrays).

        ``pin``: copy from pinned memory without blocking the host (a pageable copy is a host sync on CUDA)."""
        tokens = self.tokens.pin_memory().to(device, non_blocking=True) if pin else self.tokens.to(device)
        return Batch(tokens, self.samples, self.positions)

    @property
    def ids(self) -> torch.Tensor:
        """Input ids [s, b], contiguous."""
        return self.tokens[:, :-1].t().contiguous()

    @property
    def labels(self) -> torch.Tensor:
        """Labels [s, b] (a view)."""
        return self.tokens[:, 1:].t()

    @property
    def targets(self) -> torch.Tensor:
        """Labels flattened to the loss layer's [s·b] rows."""
        return self.labels.reshape(-1)

    @property
    def label_positions(self) -> torch.Tensor | None:
        """``.bin`` offsets of the labels [s, b], or None when the data has none."""
        return None if self.positions is None else self.positions[:, 1:].t()
