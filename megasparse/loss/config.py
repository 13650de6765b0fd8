"""Loss-layer config: which cross-entropy implementation and its options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from megasparse.configbase import ConfigError, check_renamed

GIB = 1024**3
IMPLS = ("auto", "cce", "materialized", "mcore")
"""loss.impl: which loss runs (docs/decisions/0020)."""
BACKENDS = ("gemm", "triton", "reference")
"""loss.backend: which maths computes CCE's vocabulary slices (the materialised loss has its own, ``materialized``)."""


@dataclass
class LossConfig:
    """Output layer + cross-entropy. ``cce`` never materialises [tokens, vocab] logits."""

    RENAMED: ClassVar[dict[str, dict[str, str]]] = {
        "impl": {"torch": "materialized"},
        "backend": {"torch": "reference"},
    }
    """Old values that fail with the new spelling (decision 0020)."""

    impl: Literal["auto", "cce", "materialized", "mcore"] = "auto"
    """auto (the default): cce where the materialised logits would exceed ``materialize_budget_gib`` or, on CUDA,
    where it is timed as fast (``speed_check``), materialized otherwise; resolved once per run and shape. cce: Cut
    Cross-Entropy, never forming [tokens, vocab] logits (its maths: ``backend``). materialized: whole fp32 logits,
    megatron-style vocab-parallel cross-entropy with the compact filtered backward. mcore: megatron-core's own
    vocab_parallel_cross_entropy, unmodified (the baseline; dense backward, no softcap/z-loss). Until decision 0020
    materialized was spelled ``torch``."""
    materialize_budget_gib: float = 4.0
    """impl=auto: the most memory the materialised loss may spend on its fp32 logits (rows × local vocabulary ×
    4 bytes, per micro-batch, per rank) before auto picks cce, which never forms them."""
    speed_check: bool = True
    """impl=auto on CUDA, logits within the budget: time both losses once per shape (this rank's shard, forward and
    backward, synthetic data) at the first call and run cce where it is as fast (``loss/speed.py``; the choice and
    both times are logged once). False: the memory rule alone picks. The vocab-over-PP slices use the rule."""
    filter_eps: float | Literal["auto"] | None = "auto"
    """Skip softmax-gradient blocks whose entries are all below this (the cce tile kernels, ``backend=triton``, and the
    CPU reference; the default GEMM backend is exact, decision 0203); None is the exact mode. auto
    ties it to the compute dtype: finfo(dtype).eps / 32 (bf16: 2^-12; fp32: 2^-28), below the dtype's rounding
    of the entries it skips."""
    sort_vocab: bool = True
    """Walk the vocabulary by descending mean logit in the filtered backward, so skippable tiles cluster (cce tile
    kernels with filter_eps only; 1.9x faster backward measured on the Gemma-2 shape)."""
    softcap: float | None = None
    """Logit soft-capping value (Gemma-2 style), None for off."""
    z_loss: float = 0.0
    """Coefficient of the z-loss (lse²) regulariser."""
    grad_accum_fp32: bool = True
    """Accumulate the CCE backward's dE in fp32 ([tokens, h] fp32 while the loss's backward runs) and round it to
    the compute dtype once, as the materialised loss does (the default, decision 0207). False rounds the running dE
    after every vocabulary chunk (GEMM backend) or kept tile (tile kernels): at a 128K vocabulary the final norm
    weight's gradient then lands ~1e-1 from fp32, against 9e-3 for the materialised loss (H100); it saves [tokens, h]
    × 2 bytes and a few % of the loss's time."""
    cce_scratch_mb: int | None = None
    """Bound in MiB on the exact CCE backward's chunk buffer (``backend=gemm``: the fused passes' P, [rows, c] in the
    compute dtype; the cuBLAS pass's S and P). Wider chunks mean fewer GEMM ramps and tails and fewer re-reads of dE.
    None: 56 (fused) and 48 (cuBLAS), inside issue 12's 64 MB of extra memory. On the Llama-3-8B shape (8192 rows, one
    H100, decision 0206) the loss took 0.975x torch's materialised loss at 56, 0.953x at 112, 0.940x at 224 and 0.935x
    at 448; a rank with memory to spare gains by raising it."""
    backend: Literal["gemm", "triton", "reference"] | None = None
    """Force the cce backend: gemm (exact, over bounded vocabulary chunks: on sm_90+ Triton GEMMs with the softmax in
    their epilogue for the logits and cuBLAS for dC and dE, elsewhere cuBLAS with Triton softmax kernels), triton (the
    tile kernels: gradient filtering with ``filter_eps`` and ``sort_vocab``, the least memory) or reference (the
    chunked pure-torch maths the kernels are tested against; spelled ``torch`` until decision 0020). None: gemm on
    CUDA, reference on CPU (decision 0203)."""
    vocab_over_pp: bool = False
    """Shard the output layer's vocabulary over pipeline ranks too (balances the last stage)."""
    embedding_over_pp: bool = True
    """With vocab_over_pp, shard the input embedding over pipeline ranks as well, so the first stage does not
    keep a whole vocabulary's weights and optimizer state (memory balance). Ignored without vocab_over_pp."""
    embedding_pp_split: list[float] | None = None
    """Fraction of the input-embedding rows on each pipeline stage (with embedding_over_pp). None lets the planner
    pick it: the embedding costs memory but almost no compute, so it goes where the pipeline holds the fewest
    activations (the last stages) until the estimated per-stage memory is level."""

    @property
    def scratch_bytes(self) -> int | None:
        """``cce_scratch_mb`` in bytes (None: the kernels' own bounds)."""
        return None if self.cce_scratch_mb is None else self.cce_scratch_mb * 2**20

    def resolved_impl(self, rows: int, vocab_local: int) -> str:
        """``resolve_impl``'s choice, for callers that hold a config but must not import the loss package."""
        return resolve_impl(self, rows, vocab_local)[0]

    def validate(self) -> None:
        check_renamed(LossConfig, "impl", self.impl, "loss.impl")
        check_renamed(LossConfig, "backend", self.backend, "loss.backend")
        if self.impl not in IMPLS:
            raise ConfigError(f"loss.impl={self.impl!r}: use {', '.join(IMPLS)}")
        if not self.materialize_budget_gib > 0:
            raise ConfigError(f"loss.materialize_budget_gib={self.materialize_budget_gib}: use a positive size")
        if self.impl == "mcore" and (self.softcap is not None or self.z_loss):
            raise ConfigError("loss.impl=mcore: megatron-core's loss has no softcap or z-loss; use cce or materialized")
        if self.impl == "mcore" and self.vocab_over_pp:
            raise ConfigError("loss.impl=mcore cannot shard the vocabulary over PP; use loss.impl=cce or materialized")
        if self.cce_scratch_mb is not None and self.cce_scratch_mb <= 0:
            raise ConfigError(
                f"loss.cce_scratch_mb={self.cce_scratch_mb!r}: use a positive whole number of MiB or null"
            )
        if self.backend not in (None, *BACKENDS):
            raise ConfigError(f"loss.backend={self.backend!r}: use {', '.join(BACKENDS)} or leave it unset")
        if self.filter_eps not in (None, "auto") and not 0 <= self.filter_eps < 1:
            raise ConfigError(f"loss.filter_eps={self.filter_eps}: use a value in [0, 1) or null for exact mode")
        if self.softcap is not None and self.softcap <= 0:
            raise ConfigError(f"loss.softcap={self.softcap}: use a positive cap or null")
        if self.z_loss < 0:
            raise ConfigError(f"loss.z_loss={self.z_loss} must be >= 0")


def resolve_impl(cfg: LossConfig, rows: int, vocab_local: int) -> tuple[str, str]:
    """(impl, why) for one run: ``loss.impl`` itself unless it is auto; auto picks cce when the materialised
    fp32 logits of one micro-batch on one rank (``rows`` × ``vocab_local`` × 4 bytes) exceed
    ``loss.materialize_budget_gib``, the materialised loss (impl=materialized) otherwise. The caller logs ``why``
    once."""
    if cfg.impl != "auto":
        return cfg.impl, f"loss.impl={cfg.impl} (configured)"
    gib = rows * vocab_local * 4 / GIB
    budget = cfg.materialize_budget_gib
    size = f"materialised logits {rows}x{vocab_local} fp32 = {gib:.2f} GiB"
    if gib > budget:
        return "cce", f"loss.impl=auto -> cce: {size} > loss.materialize_budget_gib={budget}"
    return "materialized", f"loss.impl=auto -> materialized: {size} <= loss.materialize_budget_gib={budget}"


def filter_threshold(filter_eps: float | str | None, dtype: torch.dtype) -> float | None:
    """The filtered backward's threshold for inputs of ``dtype``: ``filter_eps`` itself, or for auto
    finfo(dtype).eps / 32 (bf16's 2^-12 as before, fp32's 2^-28 instead of bf16's, which cost fp32 up to 10% of its
    dE accuracy on flat logits). None stays the exact mode."""
    if filter_eps == "auto":
        return torch.finfo(dtype).eps / 32
    return filter_eps
