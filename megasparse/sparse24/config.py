"""2:4 sparse FFN training config (the recipe of the sparse-pretraining paper)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megasparse.configbase import ConfigError


@dataclass
class SparsityConfig:
    """Transposable 2:4 masks on FFN weights, refreshed every ``refresh_interval`` steps."""

    enabled: bool = False
    layers: str = "all"
    """Which blocks' FFNs are sparse: all, or a comma list of global layer indices like 0,1,5."""
    refresh_interval: int = 40
    """Recompute masks every this many optimizer steps (the paper's l)."""
    decay: float = 2e-4
    """Masked-decay factor λ: λ·(¬M ⊙ W) is added to the gradient before the optimizer."""
    dense_finetune_fraction: float = 1.0 / 6.0
    """Final fraction of training run dense (masks dropped)."""
    mvue: bool = False
    """MVUE-prune output gradients (2:4 along tokens) for the weight-gradient GEMM. Off by default: with torch's
    cuSPARSELt compression the sparse weight-gradient GEMM loses to dense (docs/decisions/0301), so MVUE only
    adds variance and an extra pass."""
    backend: Literal["auto", "cusparselt", "emulate"] = "auto"
    """auto (cuSPARSELt on GPU when faster, else emulation), cusparselt, or emulate (masked dense)."""
    monitor_only: bool = False
    """Train dense but compute masks and flip rates (the dense reference of `sparsity decay-search`)."""

    def validate(self) -> None:
        if self.refresh_interval < 1:
            raise ConfigError(f"sparsity.refresh_interval={self.refresh_interval} must be >= 1")
        if not 0.0 <= self.dense_finetune_fraction < 1.0:
            raise ConfigError(f"sparsity.dense_finetune_fraction={self.dense_finetune_fraction} must be in [0, 1)")
        if self.layers != "all":
            try:
                [int(x) for x in self.layers.split(",")]
            except ValueError as e:
                raise ConfigError(f"sparsity.layers={self.layers!r}: use all or e.g. 0,1,5") from e
