"""Token-filtering config (Rho-1 selection, Collider dimension-reduced backward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megasparse.configbase import ConfigError


@dataclass
class FilterConfig:
    """Keep the top ``keep_ratio`` tokens by score; ``mode`` decides what the backward does with the rest."""

    mode: Literal["off", "loss_mask", "collider"] = "off"
    """off (dense), loss_mask (Rho-1: masked loss, dense backward), collider (backward on kept rows only)."""
    keep_ratio: float = 0.6
    """Fraction of tokens kept; k = ceil(keep_ratio · tokens) per selection group."""
    granularity: Literal["balanced", "microbatch", "sequence", "shard"] = "balanced"
    """Selection group: balanced (each sequence's part of each SP shard: static counts everywhere, so the compact
    backward never waits on the host; equals ``sequence`` without SP), microbatch (the exact Rho-1 top-k over
    the micro-batch; one host sync per micro-batch when b > 1 or under SP), sequence, or shard (per SP shard)."""
    scorer: Literal["excess", "loss", "random"] = "excess"
    """excess (model loss − reference loss), loss (model loss only), random (ablation)."""
    reference: Literal["sidecar", "ngram", "model"] = "sidecar"
    """Where reference losses come from: sidecar (data.ref_losses), ngram, or model."""
    ngram_path: str | None = None
    """Counts file written by ``megasparse ref ngram`` (reference: ngram)."""
    ref_checkpoint: str | None = None
    """Checkpoint of a same-architecture reference model, saved at any tp/pp layout (reference: model)."""

    def validate(self) -> None:
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ConfigError(f"filter.keep_ratio={self.keep_ratio} must be in (0, 1]")
