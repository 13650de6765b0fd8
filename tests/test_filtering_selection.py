"""Token selection: counts per granularity, ranking against a brute-force sort, ties, valid mask, random scorer."""

from __future__ import annotations

import math

import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.filtering.selection import kept_count, kept_total, score_tokens, select_tokens, static_counts


def _reference(scores: torch.Tensor, valid: torch.Tensor, ratio: float, granularity: str, sp: int) -> list[int]:
    """Brute force: per group, sort (valid first, NaN last, score desc, flat index asc) with Python's sort."""
    s2 = scores.reshape(scores.shape[0], -1).double()
    v2 = valid.reshape(scores.shape[0], -1)
    s, b = s2.shape
    flat = [(t * b + j, float(s2[t, j]), bool(v2[t, j])) for t in range(s) for j in range(b)]
    if granularity == "microbatch":
        groups = [flat]
    elif granularity == "sequence":
        groups = [[f for f in flat if f[0] % b == j] for j in range(b)]
    elif granularity == "balanced":
        rows = s // sp
        groups = [
            [f for f in flat if f[0] % b == j and r * rows <= f[0] // b < (r + 1) * rows]
            for r in range(sp)
            for j in range(b)
        ]
    else:
        rows = s // sp
        groups = [[f for f in flat if g * rows <= f[0] // b < (g + 1) * rows] for g in range(sp)]
    kept = []
    for grp in groups:
        k = math.ceil(ratio * len(grp) - 1e-9)
        order = sorted(grp, key=lambda f: (not f[2], math.isnan(f[1]), -f[1] if not math.isnan(f[1]) else 0, f[0]))
        kept += [f[0] for f in order[:k]]
    return sorted(kept)


@pytest.mark.parametrize("granularity", ["microbatch", "sequence", "shard", "balanced"])
@pytest.mark.parametrize("shape,ratio", [((12, 3), 0.6), ((8, 1), 0.3), ((20, 5), 0.55), ((6, 2), 1.0)])
def test_matches_bruteforce_and_counts(granularity: str, shape: tuple[int, int], ratio: float) -> None:
    g = torch.Generator().manual_seed(hash((granularity, shape, ratio)) % 2**31)
    sp = 2
    # coarse integer scores make many ties; a few invalid rows
    scores = torch.randint(-3, 4, shape, generator=g).float()
    scores[torch.rand(shape, generator=g) < 0.1] = float("nan")
    valid = torch.rand(shape, generator=g) > 0.2
    km = select_tokens(scores, ratio, granularity, valid, sp_size=sp)
    assert km.idx.tolist() == _reference(scores, valid, ratio, granularity, sp)
    s, b = shape
    expected_k = {
        "microbatch": kept_count(s * b, ratio),
        "sequence": b * kept_count(s, ratio),
        "shard": sp * kept_count(s // sp * b, ratio),
        "balanced": sp * b * kept_count(s // sp, ratio),
    }[granularity]
    assert km.k == kept_total((s, b), ratio, granularity, sp)
    assert km.k == expected_k == km.idx.numel() == int(km.mask.sum())
    assert torch.equal(km.mask.reshape(-1).nonzero().squeeze(1), km.idx)
    if granularity == "sequence":
        assert km.per_sequence_counts().tolist() == [kept_count(s, ratio)] * b
    if granularity == "shard":
        assert km.per_shard_counts(sp).tolist() == [kept_count(s // sp * b, ratio)] * sp
    if granularity == "balanced":
        assert km.per_sequence_counts().tolist() == [sp * kept_count(s // sp, ratio)] * b
        assert km.per_shard_counts(sp).tolist() == [b * kept_count(s // sp, ratio)] * sp
    assert (km.seq_count, km.shards) == static_counts((s, b), ratio, granularity, sp)  # known before selecting
    # what the selection declares static must be what it did
    if km.seq_count is not None:
        assert km.per_sequence_counts().tolist() == [km.seq_count] * b
    if km.shards > 1:
        assert km.per_shard_counts(km.shards).tolist() == [km.k // km.shards] * km.shards


def test_kept_count() -> None:
    assert kept_count(10, 0.3) == 3  # 0.3 * 10 = 3.0000000000000004 in floats
    assert kept_count(10, 0.31) == 4
    assert kept_count(7, 1.0) == 7
    assert kept_count(0, 0.5) == 0
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="keep_ratio"):
            kept_count(10, bad)


def test_ties_go_to_lower_flat_index() -> None:
    scores = torch.zeros(6, 4)
    km = select_tokens(scores, 0.25, "microbatch")
    assert km.idx.tolist() == list(range(6))
    km = select_tokens(scores, 0.5, "sequence")  # each column keeps its first 3 rows
    assert km.mask[:3].all() and not km.mask[3:].any()
    # -0.0 and +0.0 tie; NaN ranks below -inf
    km = select_tokens(torch.tensor([float("nan"), -0.0, 0.0, -math.inf]), 0.5, "microbatch")
    assert km.idx.tolist() == [1, 2]
    km = select_tokens(torch.tensor([float("nan"), -math.inf, float("nan"), -math.inf]), 0.75, "microbatch")
    assert km.idx.tolist() == [0, 1, 3]


def test_deterministic_across_layouts_and_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (64, 4), generator=g).float()
    ref = select_tokens(scores, 0.4, "microbatch")
    # a rank holding the same losses in another memory layout or precision picks the same set
    transposed = scores.t().contiguous().t()
    assert not transposed.is_contiguous()
    for other in (scores.clone(), transposed, scores.double(), scores.bfloat16()):
        assert torch.equal(select_tokens(other, 0.4, "microbatch").idx, ref.idx)


def test_invalid_tokens_only_fill() -> None:
    scores = torch.arange(10.0).reshape(10, 1)  # highest scores at the end
    valid = torch.ones(10, 1, dtype=torch.bool)
    valid[7:] = False
    km = select_tokens(scores, 0.3, "microbatch", valid)
    assert km.idx.tolist() == [4, 5, 6]  # best valid ones, not the higher-scored invalid rows
    assert torch.equal(km.loss_mask, km.mask)
    # fewer valid tokens than the quota: all valid kept, invalid rows fill up to static k
    valid[:] = False
    valid[2] = True
    km = select_tokens(scores, 0.3, "microbatch", valid)
    assert km.k == 3 and bool(km.mask[2])
    assert km.loss_mask.sum() == 1 and bool(km.loss_mask[2])


def test_shapes_and_errors() -> None:
    km = select_tokens(torch.randn(9), 0.5, "sequence")
    assert km.mask.shape == (9,) and km.k == 5 and km.per_sequence_counts().tolist() == [5]
    km = select_tokens(torch.randn(8), 0.5, "shard", sp_size=4)
    assert km.per_shard_counts(4).tolist() == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="divisible"):
        select_tokens(torch.randn(10, 2), 0.5, "shard", sp_size=4)
    with pytest.raises(ConfigError, match="granularity"):
        select_tokens(torch.randn(10, 2), 0.5, "document")
    with pytest.raises(ValueError, match="valid mask"):
        select_tokens(torch.randn(10, 2), 0.5, "microbatch", torch.ones(10, 1, dtype=torch.bool))


def test_scorers() -> None:
    g = torch.Generator().manual_seed(3)
    loss, ref = torch.rand(16, 2, generator=g) * 5, torch.rand(16, 2, generator=g) * 5
    ex = score_tokens("excess", loss.requires_grad_(), ref)
    assert not ex.requires_grad and torch.allclose(ex, loss.detach() - ref)
    assert torch.equal(score_tokens("loss", loss), loss.detach())
    with pytest.raises(ConfigError, match="reference"):
        score_tokens("excess", loss)
    with pytest.raises(ConfigError, match="scorer"):
        score_tokens("entropy", loss)
    # excess selection prefers high model loss where the reference finds the token easy
    km = select_tokens(score_tokens("excess", loss, ref), 0.25, "microbatch")
    assert (loss.detach() - ref)[km.mask].min() >= (loss.detach() - ref)[~km.mask].max()


def test_random_scorer_reproducible() -> None:
    loss = torch.zeros(32, 4)

    def pick(seed: int) -> torch.Tensor:
        return select_tokens(
            score_tokens("random", loss, generator=torch.Generator().manual_seed(seed)), 0.5, "sequence"
        ).idx

    assert torch.equal(pick(7), pick(7))
    assert not torch.equal(pick(7), pick(8))
    valid = torch.ones(32, 4, dtype=torch.bool)
    a = select_tokens(None, 0.5, "microbatch", valid, generator=torch.Generator().manual_seed(1))
    b = select_tokens(None, 0.5, "microbatch", valid, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.idx, b.idx) and a.k == 64
    # random picks are spread out, not the lowest indices
    assert a.idx.max() > 100


@pytest.mark.parametrize("granularity,sp", [("microbatch", 1), ("sequence", 1), ("shard", 2), ("shard", 4)])
@pytest.mark.parametrize("ratio", [0.1, 0.37, 0.5, 1.0])
def test_kept_total_is_what_selection_keeps(granularity: str, sp: int, ratio: float) -> None:
    """The trainer sizes compact buffers with kept_total before any selection runs: it must equal k."""
    scores = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    sel = select_tokens(scores, ratio, granularity, sp_size=sp)
    assert kept_total((12, 3), ratio, granularity, sp) == sel.k == int(sel.mask.sum())
