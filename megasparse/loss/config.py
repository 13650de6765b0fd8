"""Loss-layer config: which cross-entropy implementation and its options."""

from __future__ import annotations

from dataclasses import dataclass

from megasparse.configbase import ConfigError


@dataclass
class LossConfig:
    """Output layer + cross-entropy. ``cce`` never materialises [tokens, vocab] logits."""

    impl: str = "torch"
    """cce (Triton Cut Cross-Entropy; torch chunked reference on CPU), torch (materialised logits,
    megatron-style vocab-parallel cross-entropy with compact filtered backward), mcore (megatron-core's own
    vocab_parallel_cross_entropy, unmodified: the baseline; dense backward, no softcap/z-loss)."""
    filter_eps: float | None = 2.0**-12
    """Skip softmax-gradient blocks whose entries are all below this; None is the exact mode."""
    sort_vocab: bool = True
    """Walk the vocabulary by descending mean logit in the filtered backward, so skippable tiles cluster (cce with
    filter_eps only; 1.9x faster backward measured on the Gemma-2 shape)."""
    softcap: float | None = None
    """Logit soft-capping value (Gemma-2 style), None for off."""
    z_loss: float = 0.0
    """Coefficient of the z-loss (lse²) regulariser."""
    grad_accum_fp32: bool = False
    """Accumulate the CCE backward's dE in fp32 scratch ([tokens, h] fp32 extra) instead of in the parameter
    dtype. Each dE row takes one add per kept vocabulary tile, so in bf16 its rounding dominates: on the Gemma-2
    shape the dE error against fp32 falls from 0.37 to 0.19 filtered and from 0.71 to 0.003 exact (H200,
    docs/benchmarks/cce.md)."""
    backend: str | None = None
    """Force the cce backend: triton or torch (None: Triton on CUDA, the chunked torch reference on CPU)."""
    vocab_over_pp: bool = False
    """Shard the output layer's vocabulary over pipeline ranks too (balances the last stage)."""
    embedding_over_pp: bool = True
    """With vocab_over_pp, shard the input embedding over pipeline ranks as well, so the first stage does not
    keep a whole vocabulary's weights and optimizer state (memory balance). Ignored without vocab_over_pp."""
    embedding_pp_split: list[float] | None = None
    """Fraction of the input-embedding rows on each pipeline stage (with embedding_over_pp). None lets the planner
    pick it: the embedding costs memory but almost no compute, so it goes where the pipeline holds the fewest
    activations (the last stages) until the estimated per-stage memory is level."""

    def validate(self) -> None:
        if self.impl not in ("cce", "torch", "mcore"):
            raise ConfigError(f"loss.impl={self.impl!r}: use cce, torch or mcore")
        if self.impl == "mcore" and (self.softcap is not None or self.z_loss):
            raise ConfigError("loss.impl=mcore: megatron-core's loss has no softcap or z-loss; use cce or torch")
        if self.impl == "mcore" and self.vocab_over_pp:
            raise ConfigError("loss.impl=mcore cannot shard the vocabulary over PP; use loss.impl=cce or torch")
        if self.backend not in (None, "triton", "torch"):
            raise ConfigError(f"loss.backend={self.backend!r}: use triton, torch or leave it unset")
        if self.filter_eps is not None and not 0 <= self.filter_eps < 1:
            raise ConfigError(f"loss.filter_eps={self.filter_eps}: use a value in [0, 1) or null for exact mode")
        if self.softcap is not None and self.softcap <= 0:
            raise ConfigError(f"loss.softcap={self.softcap}: use a positive cap or null")
        if self.z_loss < 0:
            raise ConfigError(f"loss.z_loss={self.z_loss} must be >= 0")
