"""Token selection for Rho-1 / Collider filtering: which tokens' loss (and backward) to keep.

Every group keeps exactly ``kept_count(group_size, keep_ratio)`` tokens, a number fixed by the shape, so the
compacted backward (GEMMs, collectives, P2P) has a size every rank knows ahead of time without a host sync.
Ranking uses one integer key per token — (valid, score, -position) packed into an int64 — so keys are unique and
``topk`` returns the same set on every backend and every tensor-parallel rank holding the same losses, whatever
order its algorithm visits ties in.

Layout: ``scores`` is ``[s, b]`` (sequence-major, like megatron activations) or flat ``[n]`` (one sequence).
Flat indices are row-major over ``[s, b]``: token ``(t, j)`` is ``t * b + j``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megasparse.configbase import ConfigError

__all__ = [
    "GRANULARITIES",
    "SCORERS",
    "KeepMask",
    "kept_count",
    "kept_total",
    "score_tokens",
    "select_tokens",
    "static_counts",
]

GRANULARITIES = ("balanced", "microbatch", "sequence", "shard")
SCORERS = ("excess", "loss", "random")

_POS_BITS = 30  # positions inside one group must fit in 30 bits of the packed key (1 Gi tokens)


def kept_count(n: int, ratio: float) -> int:
    """Tokens kept out of a group of ``n``: ceil(ratio · n), computed so float noise cannot add one (0.3 · 10 → 3)."""
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"filter.keep_ratio={ratio} must be in (0, 1]")
    if n < 0:
        raise ValueError(f"group size {n} must be >= 0")
    return min(n, math.ceil(round(ratio * n, 9)))


@dataclass
class KeepMask:
    """The kept tokens of one micro-batch.

    ``idx`` always has exactly ``k`` entries (static shape). When a group has fewer valid tokens than its quota,
    invalid rows (ignore/padding labels) fill the rest: they sit in ``mask``/``idx`` so that shapes stay static,
    but their loss is zero anyway. Use ``loss_mask`` (kept and valid) to weight the loss.
    """

    mask: torch.Tensor
    """bool, same shape as the scores: True where the token is kept."""
    idx: torch.Tensor
    """int64 [k]: flat (row-major) indices of the kept tokens, ascending, i.e. in original order."""
    k: int
    """Number of kept tokens (static: a function of the shape, the ratio and the granularity)."""
    valid: torch.Tensor
    """bool, same shape as the scores: the valid-token mask the selection was made under."""
    seq_count: int | None = None
    """Kept tokens of every sequence when the granularity makes them equal (static), else None."""
    shards: int = 1
    """SP shards that each keep exactly k / shards tokens (1: not balanced over shards)."""

    @property
    def loss_mask(self) -> torch.Tensor:
        """Kept and valid: the tokens whose loss counts."""
        return self.mask & self.valid

    def per_sequence_counts(self) -> torch.Tensor:
        """int64 [b]: kept tokens per sequence (column); a flat [n] selection is one sequence."""
        m = self.mask if self.mask.dim() == 2 else self.mask.unsqueeze(1)
        return m.sum(dim=0)

    def per_shard_counts(self, sp_size: int) -> torch.Tensor:
        """int64 [sp_size]: kept tokens in each contiguous sequence-parallel shard of dim 0."""
        m = self.mask if self.mask.dim() == 2 else self.mask.unsqueeze(1)
        if m.shape[0] % sp_size:
            raise ValueError(f"sequence length {m.shape[0]} is not divisible by sp_size={sp_size}")
        return m.reshape(sp_size, -1).sum(dim=1)


def score_tokens(
    scorer: str,
    loss: torch.Tensor,
    ref_loss: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Selection scores (higher = more worth training on), detached, float32.

    ``excess`` is Rho-1's excess loss (model − reference): tokens the model has not learned yet but the reference
    finds predictable. ``loss`` keeps the hardest tokens. ``random`` is the ablation baseline; pass a generator
    seeded identically on every rank that must agree (e.g. from seed, step and micro-batch).
    """
    loss = loss.detach()
    if scorer == "excess":
        if ref_loss is None:
            raise ConfigError("filter.scorer=excess needs reference losses; set filter.reference or use scorer=loss")
        if ref_loss.shape != loss.shape:
            raise ValueError(f"reference losses {tuple(ref_loss.shape)} do not match losses {tuple(loss.shape)}")
        return loss.float() - ref_loss.detach().to(loss.device, torch.float32)
    if scorer == "loss":
        return loss.float()
    if scorer == "random":
        device = generator.device if generator is not None else loss.device
        return torch.rand(loss.shape, generator=generator, device=device).to(loss.device)
    raise ConfigError(f"filter.scorer={scorer!r}: use excess, loss or random")


def _sortable_bits(x: torch.Tensor) -> torch.Tensor:
    """Map float32 values to int64 in [0, 2^32) with the same order; NaN ranks below -inf, -0.0 equals +0.0."""
    x = x.float()
    nan = torch.isnan(x)
    bits = (torch.where(nan, 0.0, x) + 0.0).view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse their order
    return torch.where(nan, 0, bits.to(torch.int64) + (1 << 31))


def _groups(shape: tuple[int, ...], granularity: str, sp_size: int) -> tuple[int, int]:
    """(groups, group size) of a [s, b] micro-batch; the group axis is made contiguous by _to_groups."""
    s, b = shape
    if granularity == "microbatch":
        return 1, s * b
    if granularity == "sequence":
        return b, s
    if granularity in ("shard", "balanced"):
        if sp_size < 1 or s % sp_size:
            raise ConfigError(
                f"filter.granularity={granularity}: sequence length {s} must be divisible by the SP size {sp_size}"
            )
        if granularity == "balanced":
            return sp_size * b, s // sp_size
        return sp_size, (s // sp_size) * b
    raise ConfigError(f"filter.granularity={granularity!r}: use balanced, microbatch, sequence or shard")


def _static_counts(granularity: str, b: int, sp_size: int, k_group: int) -> tuple[int | None, int]:
    """(kept per sequence or None, SP shards balanced) that a granularity fixes by shape alone."""
    if granularity == "balanced":
        return sp_size * k_group, sp_size
    if granularity == "sequence":
        return k_group, 1
    if granularity == "shard":
        return (sp_size * k_group if b == 1 else None), sp_size
    return (k_group if b == 1 else None), 1


def static_counts(
    shape: tuple[int, int], keep_ratio: float, granularity: str, sp_size: int = 1
) -> tuple[int | None, int]:
    """(kept tokens per sequence or None, SP shards balanced) that ``select_tokens`` fixes for a [s, b] micro-batch."""
    _, size = _groups(shape, granularity, sp_size)
    return _static_counts(granularity, shape[1], sp_size, kept_count(size, keep_ratio))


def kept_total(shape: tuple[int, int], keep_ratio: float, granularity: str, sp_size: int = 1) -> int:
    """Tokens :func:`select_tokens` keeps in a [s, b] micro-batch: fixed by the shape, so buffers are sized ahead."""
    n_groups, size = _groups(shape, granularity, sp_size)
    return n_groups * kept_count(size, keep_ratio)


def select_tokens(
    scores: torch.Tensor | None,
    keep_ratio: float,
    granularity: str,
    valid: torch.Tensor | None = None,
    *,
    sp_size: int = 1,
    generator: torch.Generator | None = None,
) -> KeepMask:
    """Keep the top ``ceil(keep_ratio · group)`` tokens by score in every group.

    Groups: ``microbatch`` (all tokens), ``sequence`` (each column: equal counts per sequence keep attention
    backward a plain batched call), ``shard`` (each of ``sp_size`` contiguous slices of dim 0: every SP rank's
    compacted collective has the same size), ``balanced`` (each sequence's slice of each SP shard: both at once,
    so the compact backward needs no host sync and no padding). Ties go to the lower flat index. Invalid tokens
    (``valid`` False) rank below every valid one. ``scores=None`` draws uniform random scores from ``generator``
    (ablation).
    """
    if scores is None:
        if valid is None:
            raise ValueError("select_tokens needs scores or a valid mask to take the shape of random scores from")
        device = generator.device if generator is not None else valid.device
        scores = torch.rand(valid.shape, generator=generator, device=device).to(valid.device)
    flat_input = scores.dim() == 1
    if scores.dim() not in (1, 2):
        raise ValueError(f"scores must be [s, b] or [n], got shape {tuple(scores.shape)}")
    if valid is None:
        valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    if valid.shape != scores.shape:
        raise ValueError(f"valid mask {tuple(valid.shape)} does not match scores {tuple(scores.shape)}")
    valid = valid.to(device=scores.device, dtype=torch.bool)

    s2 = scores.detach().unsqueeze(1) if flat_input else scores.detach()
    v2 = valid.unsqueeze(1) if flat_input else valid
    s, b = s2.shape
    n_groups, size = _groups((s, b), granularity, sp_size)
    k_group = kept_count(size, keep_ratio)
    if size >= 1 << _POS_BITS:
        raise ValueError(f"selection group of {size} tokens is too large (limit {1 << _POS_BITS})")

    # Group-major views: row g holds group g's tokens in ascending flat-index order.
    if granularity == "sequence":
        gs, gv = s2.t(), v2.t()
    elif granularity == "balanced":  # cell (shard r, sequence j) holds positions [r·S, (r+1)·S) of column j
        cells = lambda t: t.reshape(sp_size, size, b).transpose(1, 2).reshape(n_groups, size)  # noqa: E731
        gs, gv = cells(s2), cells(v2)
    else:
        gs, gv = s2.reshape(n_groups, size), v2.reshape(n_groups, size)
    pos = torch.arange(size, device=scores.device, dtype=torch.int64)
    key = (gv.to(torch.int64) << 62) | (_sortable_bits(gs) << _POS_BITS) | ((1 << _POS_BITS) - 1 - pos)
    top = torch.topk(key, k_group, dim=1, sorted=False).indices  # [groups, k_group], positions within group

    if granularity == "sequence":
        flat = top * b + torch.arange(b, device=scores.device).unsqueeze(1)
    elif granularity == "balanced":
        g = torch.arange(n_groups, device=scores.device).unsqueeze(1)  # g = r·b + j
        flat = ((g // b) * size + top) * b + g % b
    else:
        flat = top + (torch.arange(n_groups, device=scores.device) * size).unsqueeze(1)
    idx = torch.sort(flat.reshape(-1)).values
    mask = torch.zeros(s * b, dtype=torch.bool, device=scores.device).index_fill_(0, idx, True)  # no host sync
    seq_count, shards = _static_counts(granularity, b, sp_size, k_group)
    return KeepMask(
        mask=mask.view(scores.shape), idx=idx, k=idx.numel(), valid=valid, seq_count=seq_count, shards=shards
    )
