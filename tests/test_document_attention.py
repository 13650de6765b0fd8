"""Document-aware attention (``data.document_attention``, decision 1200).

Op level: ``ops/attention.py`` with ``DocSpans`` against an fp64 masked reference, forward, dense backward and the
compact (Collider) backward, on odd shapes. Model level: a packed window trains exactly like each of its documents
run alone from position 0 (tp 1, and tp 2 × pp 2 + SP on gloo; with and without collider).
"""

from __future__ import annotations

import pytest
import torch

from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans, reference_attention
from megasparse.ops.rope_kernels import rope_reference

EOD = 7


def test_spans_of_a_window():
    """The EOD belongs to the document it ends; the token after it starts a new one at position 0."""
    ids = torch.tensor([[1, 2, EOD, 3, EOD, EOD, 4], [EOD, 5, 5, 5, 5, 5, EOD]]).t()
    docs = DocSpans.from_ids(ids, EOD)
    assert docs.segments.t().tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert docs.positions.t().tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    allowed = docs.allowed()[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False, False]


def window_ids(s: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """[s, b] ids with different boundaries per sequence: several documents; none; EOD first and last."""
    ids = torch.randint(10, 50, (s, b), generator=gen)
    ids[[3, 4, 9], 0] = EOD  # several documents, one of a single token (the EOD at 4)
    if b > 2:
        ids[[0, s - 1], 2] = EOD  # a one-token document at the start, an EOD as the last token
    return ids  # sequence 1 (b > 1): one document crossing nothing


SHAPES = [  # (s, b, nq, nkv, d)
    (13, 3, 4, 2, 8),
    (11, 1, 3, 1, 16),
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(qkv: torch.Tensor, ids: torch.Tensor, nq: int, nkv: int, keep: torch.Tensor | None = None):
    """fp64 attention of qkv [s, b, (nq+2nkv)d] within documents, RoPE at document positions; with ``keep``
    [s, b] bool the Collider semantics (filtered keys, values and score columns stop-gradient)."""
    s, b, w = qkv.shape
    d = w // (nq + 2 * nkv)
    docs = DocSpans.from_ids(ids, EOD)
    cos, sin = rope_tables(s, d, 10000.0, "cpu", torch.float64)
    heads = qkv.view(s, b, nq + 2 * nkv, d).permute(1, 2, 0, 3)
    pos = docs.positions.t()
    q = rope_reference(heads[:, :nq], cos, sin, pos)
    k = rope_reference(heads[:, nq : nq + nkv], cos, sin, pos)
    v = heads[:, nq + nkv :]
    allowed = docs.allowed()
    if keep is None:
        out = reference_attention(q, k, v, allowed, d**-0.5)
    else:
        kk = keep.t()[:, None, :, None]
        k, v = torch.where(kk, k, k.detach()), torch.where(kk, v, v.detach())
        g = nq // nkv
        scores = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * d**-0.5
        col = keep.t()[:, None, None, :]
        scores = torch.where(col, scores, scores.detach()).masked_fill(~allowed, float("-inf"))
        out = scores.softmax(-1) @ v.repeat_interleave(g, 1)
    return out.permute(2, 0, 1, 3).reshape(s, b, nq * d)


def inputs(shape, dtype, seed=0):
    s, b, nq, nkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen, dtype=torch.float64)
    gout = torch.randn(s, b, nq * d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(s, d, 10000.0, "cpu")
    return qkv, gout, cos, sin, window_ids(s, b, gen)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_dense_forward_backward_match_reference(shape, dtype, recompute):
    s, b, nq, nkv, d = shape
    qkv, gout, cos, sin, ids = inputs(shape, dtype)
    x = qkv.to(dtype).requires_grad_()
    y = attention(x, nq, nkv, cos, sin, recompute, docs=DocSpans.from_ids(ids, EOD))
    y.backward(gout.to(dtype))
    xr = qkv.clone().requires_grad_()
    yr = reference(xr, ids, nq, nkv)
    yr.backward(gout)
    assert rel(y, yr) < TOL[dtype]
    assert rel(x.grad, xr.grad) < TOL[dtype]
    # documents really change the result: plain causal attention differs
    plain = attention(qkv.to(dtype), nq, nkv, cos, sin)
    assert rel(plain, yr) > 10 * TOL[dtype]


def kept_rows(s: int, b: int, counts: list[int], gen: torch.Generator) -> torch.Tensor:
    """Flat kept rows (position·b + sequence, ascending) with ``counts[j]`` random positions of sequence j."""
    rows = [torch.randperm(s, generator=gen)[:c] * b + j for j, c in enumerate(counts)]
    return torch.cat(rows).sort().values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "counts", "static"),
    [
        (SHAPES[0], [5, 9, 2], False),  # padded per sequence (data-dependent counts)
        (SHAPES[0], [6, 6, 6], True),  # balanced selection: static counts, no padding
        (SHAPES[1], [7], True),  # one sequence: the in-order path
    ],
)
def test_compact_backward_matches_collider_reference(shape, counts, static, dtype):
    s, b, nq, nkv, d = shape
    qkv, gout, cos, sin, ids = inputs(shape, dtype, seed=1)
    idx = kept_rows(s, b, counts, torch.Generator().manual_seed(2))
    meta = KeepMeta(idx, s * b, batch=b, seq_count=counts[0] if static else None)
    x = qkv.to(dtype).requires_grad_()
    y = attention(x, nq, nkv, cos, sin, docs=DocSpans.from_ids(ids, EOD))
    g_rows = gout.reshape(s * b, -1)[idx].to(dtype)
    y.backward(CompactGrad(g_rows, meta, y.shape))
    keep = torch.zeros(s * b, dtype=torch.bool)
    keep[idx] = True
    keep = keep.view(s, b)
    xr = qkv.clone().requires_grad_()
    yr = reference(xr, ids, nq, nkv, keep)
    yr.backward(gout * keep[..., None])
    got = x.grad
    assert isinstance(got, CompactGrad)
    assert rel(got.rows, xr.grad.reshape(s * b, -1)[idx]) < TOL[dtype]
