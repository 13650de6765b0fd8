"""FlexAttention for document attention (``ops/doc_flex.py``, decision 1201), on CPU.

flex_attention runs eagerly on CPU (its unfused reference), so these tests run the mask_mod, the block mask, the
lse convention and the gradient plumbing the GPU's compiled kernel runs: forward and lse against fp64, the dense
backward (the CPU kernel's with flex's out/lse, and the GPU's recomputed-flex backward forced onto CPU), the compact
backward after a flex forward, odd lengths over several tiles, GQA, a one-document window and 1-token documents.
"""

from __future__ import annotations

import pytest
import torch
from test_document_attention import EOD, TOL, kept_rows, reference, rel

from megasparse.ops import doc_flex
from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans, reference_attention

if not doc_flex.available():
    pytest.skip("this torch has no FlexAttention", allow_module_level=True)

SHAPES = [  # (s, b, nq, nkv, d): s over two tiles and not a multiple of 128; GQA; one sequence
    (200, 3, 4, 2, 8),
    (11, 1, 3, 1, 16),
]


def flex_ids(s: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """[s, b]: several documents (one past the first tile); one document; 1-token documents (a run of EODs)."""
    ids = torch.randint(10, 50, (s, b), generator=gen)
    ids[[3, 4, min(150, s - 2)], 0] = EOD
    if b > 2:
        ids[: s // 2, 2] = EOD  # half the window one-token documents
    return ids


def flex_inputs(shape, seed=0):
    s, b, nq, nkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen, dtype=torch.float64)
    gout = torch.randn(s, b, nq * d, generator=gen, dtype=torch.float64)
    return qkv, gout, rope_tables(s, d, 10000.0, "cpu"), flex_ids(s, b, gen)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Run the GPU's dense backward (flex again under autograd) on CPU: torch refuses flex with grad on CPU only
    by a device check; its eager reference backward is exact."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(doc_flex, "has_backward", lambda q: True)


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_natural_log_lse_match_fp64(shape):
    s, b, nq, nkv, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for h in (nq, nkv, nkv))
    docs = DocSpans.from_ids(flex_ids(s, b, gen), EOD, "flex")
    out, lse = doc_flex.flex_forward(q.float(), k.float(), v.float(), docs, d**-0.5)
    allowed = docs.allowed()
    ref = reference_attention(q, k, v, allowed, d**-0.5)
    scores = (q @ k.repeat_interleave(nq // nkv, 1).transpose(-1, -2)) * d**-0.5
    ref_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    assert rel(out, ref) < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5  # natural log: base 2 would be off by a factor 1.44
    assert docs.derived(("flex_mask", "cpu"), lambda: None) is doc_flex.block_mask(docs, q.device)  # memoised


def _dense(shape, recompute):
    s, b, nq, nkv, d = shape
    qkv, gout, (cos, sin), ids = flex_inputs(shape)
    x = qkv.float().requires_grad_()
    y = attention(x, nq, nkv, cos, sin, recompute, docs=DocSpans.from_ids(ids, EOD, "flex"))
    y.backward(gout.float())
    xr = qkv.clone().requires_grad_()
    reference(xr, ids, nq, nkv).backward(gout)
    assert rel(y, reference(qkv, ids, nq, nkv)) < TOL[torch.float32]
    assert rel(x.grad, xr.grad) < TOL[torch.float32]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_dense_backward_matches_reference(shape, recompute):
    """CPU: flex forward, the CPU kernel's backward with flex's out and lse."""
    _dense(shape, recompute)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.usefixtures("flex_backward_on_cpu")
def test_recomputed_flex_backward_matches_reference(recompute):
    """The GPU's dense backward: flex again under autograd, RoPE undone at the document positions."""
    _dense(SHAPES[0], recompute)


@pytest.mark.parametrize(("counts", "static"), [([50, 90, 20], False), ([60, 60, 60], True)])
def test_compact_backward_after_flex_forward(counts, static):
    """Collider: the forward's lse rows of the kept queries (flex's) feed the bias kernel's compact backward."""
    shape = SHAPES[0]
    s, b, nq, nkv, d = shape
    qkv, gout, (cos, sin), ids = flex_inputs(shape, seed=1)
    idx = kept_rows(s, b, counts, torch.Generator().manual_seed(2))
    meta = KeepMeta(idx, s * b, batch=b, seq_count=counts[0] if static else None)
    x = qkv.float().requires_grad_()
    y = attention(x, nq, nkv, cos, sin, docs=DocSpans.from_ids(ids, EOD, "flex"))
    y.backward(CompactGrad(gout.reshape(s * b, -1)[idx].float(), meta, y.shape))
    keep = torch.zeros(s * b, dtype=torch.bool)
    keep[idx] = True
    keep = keep.view(s, b)
    xr = qkv.clone().requires_grad_()
    reference(xr, ids, nq, nkv, keep).backward(gout * keep[..., None])
    assert rel(x.grad.rows, xr.grad.reshape(s * b, -1)[idx]) < TOL[torch.float32]


def test_auto_keeps_the_bias_on_cpu():
    q = torch.zeros(1, 1, 4, 8)
    assert not doc_flex.chosen("auto", q) and doc_flex.chosen("flex", q) and not doc_flex.chosen("bias", q)
    assert not doc_flex.chosen("auto", q.bfloat16())


@pytest.mark.usefixtures("flex_backward_on_cpu")
def test_packed_window_equals_documents_alone_with_flex_tp1(monkeypatch):
    """The trainer with ``data.document_attention_kernel=flex`` (the GPU's dense backward through the forward's kept
    flex graph, decision 1202; the compact backward after it; under the full layer checkpoint the recomputed-flex
    backward) trains each document as if alone."""
    from distributed import run_distributed
    from test_document_attention import COLLIDER, assert_documents_alone, packed_run

    calls = {"forward": 0, "backward": 0, "forward_graph": 0}
    for name in calls:
        fn = getattr(doc_flex, f"flex_{name}")

        def counted(*a, fn=fn, name=name):
            calls[name] += 1
            return fn(*a)

        monkeypatch.setattr(doc_flex, f"flex_{name}", counted)
    flex = ["data.document_attention_kernel=flex"]
    runs = [flex, flex + COLLIDER, flex + ["model.recompute=full"]]
    dense, collider, full = run_distributed(packed_run, 1, runs)[0]
    assert calls["forward"] > 0 and calls["backward"] > 0 and calls["forward_graph"] > 0, calls
    assert_documents_alone([dense], False)
    assert_documents_alone([collider], True)
    assert_documents_alone([full], False)


def test_kernel_key_is_checked():
    from tiny import tiny

    from megasparse.config import load_config
    from megasparse.configbase import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'flex'"):
        load_config(None, tiny(data__document_attention_kernel="flx"))


def test_new_documents_do_not_recompile(monkeypatch):
    """The GPU's compiled route (``torch.compile(..., dynamic=False)`` of create_block_mask and flex_attention)
    traces once: a fresh mask_mod closure over new segments each micro-batch hits the cache, so nothing compiles
    inside a CUDA-graph capture after the warm-up. A counting backend stands in for inductor on CPU."""
    import torch._dynamo.testing as dt
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    counters = dt.CompileCounter(), dt.CompileCounter()
    compiled = (
        torch.compile(flex_attention, backend=counters[0], dynamic=False),
        torch.compile(create_block_mask, backend=counters[1], dynamic=False),
    )
    monkeypatch.setattr(doc_flex, "_fns", lambda cuda: compiled)
    gen = torch.Generator().manual_seed(0)
    for n in range(3):
        ids = torch.randint(10, 50, (150, 2), generator=gen)
        ids[torch.randint(0, 150, (3 + n,), generator=gen), 0] = EOD
        q, k = torch.randn(2, 4, 150, 16, generator=gen), torch.randn(2, 2, 150, 16, generator=gen)
        out, _ = doc_flex.flex_forward(q, k, k, DocSpans.from_ids(ids, EOD, "flex"), 0.25)
        assert rel(out, reference_attention(q, k, k, DocSpans.from_ids(ids, EOD).allowed(), 0.25)) < 1e-5
    assert [c.frame_count for c in counters] == [1, 1]


def _flex_packed_run(runs: list[list[str]]) -> list[dict]:
    """``packed_run`` in a worker process with the GPU's recomputed-flex backward on CPU (the fixture's patches)."""
    import torch.nn.attention.flex_attention as fa
    from test_document_attention import packed_run

    fa._validate_device = lambda *a: None
    doc_flex.has_backward = lambda q: True
    return packed_run(runs)


def test_packed_window_equals_documents_alone_with_flex_tp2_sp():
    """TP 2 + SP on gloo: the attention sees the whole window after the all-gather; flex on each rank's heads."""
    from distributed import run_distributed
    from test_document_attention import COLLIDER, assert_documents_alone

    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "data.document_attention_kernel=flex"]
    runs = run_distributed(_flex_packed_run, 2, [layout, layout + COLLIDER])
    assert_documents_alone([r[0] for r in runs], False)
    assert_documents_alone([r[1] for r in runs], True, sp=2)
