"""A ChunkFlow last chunk with packed short documents on FlexAttention (``ops/tail_flex.py``, decision 1239), on CPU.

flex runs eagerly on CPU (its unfused reference), so these tests run the GPU's mask rule, block mask, key/value
concatenation and gradient split: the prefix attention of such a chunk against the plain-torch reference with the
document mask and the tail-only prefix (fp64 and fp32, a tail across a tile boundary, several documents with a
one-token one, GQA 2:1 and 3:1, a q/k/v bias), forward and gradients into q/k/v and into the prefix's keys/values,
on each backward route: CPU production (flex forward, the bias kernels' backward), and the GPU's routes forced onto
CPU (flex's own backward through the kept graph, or by a rerun). Broken mask rules must fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from megasparse.ops import doc_flex, tail_flex
from megasparse.ops.attention import rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans
from megasparse.ops.prefix_attention import prefix_attention, prefix_attention_reference

if not doc_flex.available():
    pytest.skip("this torch has no FlexAttention", allow_module_level=True)

CASES = {  # (chunk, prefix, nq, nkv, d, pieces: the tail first, then documents; the rest is padding)
    "gqa2-tiles": (200, 400, 4, 2, 16, [150, 20, 1, 25]),  # the tail crosses the first 128-row tile
    "gqa3-odd": (37, 74, 3, 1, 8, [13, 9, 1, 11]),
}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def tail_docs(chunk: int, prefix: int, pieces: list[int], kernel: str = "flex") -> DocSpans:
    """Piece 0 the tail (RoPE from ``prefix``), the others documents from 0, then one padding document."""
    seg, pos = [], []
    for i, n in enumerate(pieces + [chunk - sum(pieces)]):
        seg += [i] * n
        pos += [(prefix if i == 0 else 0) + t for t in range(n)]
    return DocSpans(torch.tensor(seg).view(-1, 1), torch.tensor(pos).view(-1, 1), kernel)


class Source:
    """A ``PrefixSource`` of fixed keys/values that records the gradients it receives."""

    def __init__(self, kp, vp, rows=None):
        self.kp, self.vp, self.rows, self.got = kp, vp, rows, None

    def prefix(self):
        return self.kp.detach(), self.vp.detach()

    def kept(self):
        return self.rows

    def add_grad(self, dk, dv, rows=None):
        assert self.got is None, "one gradient per backward"
        self.got = (dk, dv, rows)


def inputs(case: str, dtype: torch.dtype, seed: int = 0):
    s, prefix, nq, nkv, d, pieces = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, 1, (nq + 2 * nkv) * d, generator=gen, dtype=torch.float64)
    bias = torch.randn((nq + 2 * nkv) * d, generator=gen, dtype=torch.float64)
    kp, vp = (torch.randn(1, nkv, prefix, d, generator=gen, dtype=torch.float64) for _ in range(2))
    gy = torch.randn(s, 1, nq * d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(prefix + s, d, 10000.0, "cpu", torch.float64)
    return [t.to(dtype) for t in (qkv, bias, kp, vp, gy, cos, sin)]


@pytest.fixture(params=["cpu", "graph", "rerun"])
def route(request, monkeypatch) -> str:
    """``cpu``: production on CPU (flex forward, the bias kernels' backward with flex's out and lse); ``graph`` and
    ``rerun``: the GPU's backward through flex itself (torch refuses flex with grad on CPU only by a device check;
    its eager backward is exact), the forward's graph kept or flex run again (a saved-tensor hook is active)."""
    if request.param != "cpu":
        import torch.nn.attention.flex_attention as fa

        monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
        monkeypatch.setattr(doc_flex, "has_backward", lambda q: True)
    return request.param


def run(case: str, dtype: torch.dtype, route: str, kernel: str = "flex", width: int | None = None):
    """The packed last chunk through ``prefix_attention`` and through the reference (fp64): outputs and gradients
    (qkv, bias, prefix k, prefix v) of each, and the chunk's spans. ``width``: flex's keys padded to it."""
    s, prefix, nq, nkv, d, pieces = CASES[case]
    qkv, bias, kp, vp, gy, cos, sin = inputs(case, dtype)
    docs = tail_docs(s, prefix, pieces, kernel)
    x, b = qkv.clone().requires_grad_(), bias.clone().requires_grad_()
    src = Source(kp, vp)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    if route == "rerun":
        with hooks:
            y, k, v = prefix_attention(x, nq, nkv, cos, sin, prefix, src, b, docs, pieces[0], width)
    else:
        y, k, v = prefix_attention(x, nq, nkv, cos, sin, prefix, src, b, docs, pieces[0], width)
    y.backward(gy)
    assert src.got[2] is None
    mine = (y, k, v, x.grad, b.grad, src.got[0], src.got[1])
    x64, b64, k64, v64 = (t.double().requires_grad_() for t in (qkv, bias, kp, vp))
    ref = prefix_attention_reference(x64, nq, nkv, cos.double(), sin.double(), prefix, k64, v64, b64, None, docs,
                                     pieces[0])  # fmt: skip
    ref[0].backward(gy.double())
    return mine, (*ref, x64.grad, b64.grad, k64.grad, v64.grad), docs


def worst(mine, ref) -> float:
    return max(((a.double() - r).norm() / r.norm()).item() for a, r in zip(mine, ref))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_tail_on_flex_matches_reference(case: str, dtype: torch.dtype, route: str, padded: bool):
    """``padded``: the keys padded with zeros to a longer sequence's (3 tiles more than P + C; ChunkFlow's route)."""
    s, prefix = CASES[case][:2]
    width = prefix + s + 3 * doc_flex.BLOCK + 5 if padded else None
    mine, ref, docs = run(case, dtype, route, width=width)
    assert worst(mine, ref) < TOL[dtype]
    keys = [k for k in docs._cache if isinstance(k, tuple)]
    assert ("tail_flex_mask", CASES[case][5][0], prefix, width or prefix + s, "cpu") in keys  # flex ran, memoised
    assert any(k[0] == "bias" for k in keys) == (route == "cpu")  # the bias kernels ran only for the CPU backward


def test_a_chunk_past_the_width_runs_unpadded():
    """A prefix longer than the run was sized for (P + C > width): that chunk's keys are its exact P + C (its own
    variant, compiled when it comes), with the same numbers."""
    s, prefix = CASES["gqa2-tiles"][:2]
    mine, ref, docs = run("gqa2-tiles", torch.float64, "cpu", width=prefix + s - 1)
    assert worst(mine, ref) < 1e-10
    assert ("tail_flex_mask", CASES["gqa2-tiles"][5][0], prefix, prefix + s, "cpu") in docs._cache
    assert (
        tail_flex.width_for(s, prefix, prefix + s - 1) is None
        and tail_flex.width_for(s, prefix, prefix + s) == prefix + s
    )


def test_bias_kernel_keeps_the_merge():
    """``data.document_attention_kernel=bias`` (and ``auto`` on CPU): the old two-kernel path, the same numbers."""
    for kernel in ("bias", "auto"):
        mine, ref, docs = run("gqa3-odd", torch.float64, "cpu", kernel)
        assert worst(mine, ref) < 1e-10
        assert not any(isinstance(k, tuple) and k[0] == "tail_flex_mask" for k in docs._cache)


def _every_row_sees_the_prefix(start, tail, pre, qseg, kseg):
    def rule(b, h, qi, ki):
        own = ki >= start
        return (~own & pre[ki]) | (own & (ki - start <= qi) & (qseg[b, qi] == kseg[b, ki]))

    return rule


def _no_document_boundary(start, tail, pre, qseg, kseg):
    def rule(b, h, qi, ki):
        own = ki >= start
        return (~own & tail[qi] & pre[ki]) | (own & (ki - start <= qi))

    return rule


def _padding_is_seen(start, tail, pre, qseg, kseg):
    def rule(b, h, qi, ki):
        own = ki >= start
        return (~own & tail[qi]) | (own & (ki - start <= qi) & (qseg[b, qi] == kseg[b, ki]))

    return rule


@pytest.mark.parametrize("mutant", [_every_row_sees_the_prefix, _no_document_boundary, _padding_is_seen])
def test_a_broken_mask_fails(monkeypatch, mutant):
    """The comparison catches a mask that lets the documents see the prefix or each other, or the tail see the
    zero keys that pad the prefix (the GPU's route, keys padded)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(doc_flex, "has_backward", lambda q: True)
    monkeypatch.setattr(tail_flex, "_rule", mutant)
    s, prefix = CASES["gqa2-tiles"][:2]
    mine, ref, _ = run("gqa2-tiles", torch.float64, "graph", width=prefix + s + 2 * doc_flex.BLOCK)
    head = CASES["gqa2-tiles"][5][0]
    wrong = (mine[0] - ref[0]).abs()
    if mutant is _padding_is_seen:  # the zero keys dilute the tail's softmax; the documents never see them
        assert wrong[:head].amax() > 1e-3 and wrong[head:].amax() < 1e-10
        return
    assert wrong[:head].amax() < 1e-10 and wrong[head:].amax() > 1e-3  # the tail's rows are right either way
    if mutant is _every_row_sees_the_prefix:
        assert ((mine[5] - ref[5]).norm() / ref[5].norm()).item() > 1e-3  # the documents' rows train the prefix


def test_compact_backward_after_flex_forward():
    """Collider: flex's out and lse feed the bias kernels' compact backward; only the tail's kept rows reach the
    prefix's kept rows."""
    s, prefix, nq, nkv, d, pieces = CASES["gqa2-tiles"]
    qkv, bias, kp, vp, gy, cos, sin = inputs("gqa2-tiles", torch.float64, seed=1)
    docs = tail_docs(s, prefix, pieces)
    keep = torch.rand(prefix + s, generator=torch.Generator().manual_seed(2)) < 0.5
    keep[prefix + 1] = keep[prefix + pieces[0] + 1] = True  # a kept tail row and a kept document row
    own, pre_rows = keep[prefix:].nonzero()[:, 0], keep[:prefix].nonzero()[:, 0]
    x = qkv.clone().requires_grad_()
    src = Source(kp, vp, pre_rows)
    y, _, _ = prefix_attention(x, nq, nkv, cos, sin, prefix, src, None, docs, pieces[0])
    assert ("tail_flex_mask", pieces[0], prefix, prefix + s, "cpu") in docs._cache
    gy = gy * keep[prefix:, None, None]
    y.backward(CompactGrad(gy.view(s, -1)[own], KeepMeta(own, s), y.shape))
    x64, k64, v64 = (t.clone().requires_grad_() for t in (qkv, kp, vp))
    ref = prefix_attention_reference(x64, nq, nkv, cos, sin, prefix, k64, v64, None, keep, docs, pieces[0])
    ref[0].backward(gy)
    torch.testing.assert_close(y, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad.rows, x64.grad.view(s, -1)[own], rtol=1e-10, atol=1e-10)
    dk, dv, rows = src.got
    assert torch.equal(rows, pre_rows)
    torch.testing.assert_close(dk, k64.grad[:, :, pre_rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, v64.grad[:, :, pre_rows], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("width", [None, 600])
def test_compiled_once_per_prefix_length(monkeypatch, width):
    """The GPU's compiled route (static shapes) traces once per prefix length: new documents and a new tail length
    at the same prefix hit the cache (the tail's length is a device tensor, not a constant). With the keys padded to
    a ``width`` (ChunkFlow's route, decision 1248) it traces once for every prefix: the prefix's length is a device
    tensor too. A counting backend stands in for inductor."""
    import torch._dynamo.testing as dt

    counters = dt.CompileCounter(), dt.CompileCounter()
    compiled = (
        torch.compile(tail_flex._tail_flex_attention, backend=counters[0], dynamic=False),
        torch.compile(tail_flex._tail_block_mask, backend=counters[1], dynamic=False),
    )
    monkeypatch.setattr(tail_flex, "_fns", lambda cuda: compiled)
    torch._dynamo.reset()
    s, nq, nkv, d = 150, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    for prefix, pieces, frames in [(150, [40, 30], 1), (150, [99, 1, 20], 1), (300, [7, 60], 1 if width else 2)]:
        q, k, v = (torch.randn(1, h, s, d, generator=gen) for h in (nq, nkv, nkv))
        kp, vp = (torch.randn(1, nkv, prefix, d, generator=gen) for _ in range(2))
        docs = tail_docs(s, prefix, pieces)
        out, _, _, _, _ = tail_flex.forward(q, k, v, (kp, vp), docs, pieces[0], d**-0.5, False, width)
        head = torch.arange(s)[:, None] < pieces[0]
        allowed = torch.cat([head.expand(s, prefix), docs.allowed()[0, 0]], 1)
        scores = (q @ torch.cat([kp, k], 2).repeat_interleave(2, 1).transpose(-1, -2)) * d**-0.5
        ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ torch.cat([vp, v], 2).repeat_interleave(2, 1)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert [c.frame_count for c in counters] == [frames, frames]


def test_compiled_variants_are_bounded(monkeypatch):
    """Past dynamo's recompile limit a new prefix length is refused (the bias kernels run it) with one warning,
    while the variants already compiled stay chosen: dynamo never falls back to flex's eager, [C, P + C] route."""
    monkeypatch.setattr(tail_flex, "_SHAPES", set())
    monkeypatch.setattr(tail_flex, "_FN", {})
    monkeypatch.setattr(tail_flex, "_limit", lambda: 3)
    key = [((1, 8, 64, 16), 128, torch.bfloat16, True)]
    two = [((1, 8, 64, 16), 192, torch.bfloat16, g) for g in (False, True)]
    assert tail_flex._room(key) and tail_flex._room(two) and tail_flex._room(key)
    with pytest.warns(UserWarning, match="recompile limit"):
        assert not tail_flex._room([((1, 8, 64, 16), 256, torch.bfloat16, True)])
    assert tail_flex._room(two) and len(tail_flex._SHAPES) == 3


def test_packed_tail_benchmark_small(tmp_path):
    """``bench_document_attention.py --packed-tail --small``: the mode the lead runs on a GPU, tiny on the CPU."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_document_attention.py"
    spec = importlib.util.spec_from_file_location("bench_document_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tail.json"
    assert bench.main(["--small", "--packed-tail", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "packed_tail" and [c["prefix"] for c in res["cases"]] == [160, 320]
    for c in res["cases"]:
        assert c["documents"] > 3 and c["flex_ran"]
        assert min(c["causal_ms"], c["bias_ms"], c["flex_ms"], c["flex_build_ms"], c["bias_build_ms"]) > 0
