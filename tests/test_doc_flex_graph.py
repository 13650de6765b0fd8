"""flex's autograd graph kept from the forward for the dense backward (``AttentionFn``, decision 1202), on CPU.

The GPU's route is forced onto CPU as ``test_doc_flex.py`` does (flex's device check lifted, ``has_backward`` on):
the kept graph's gradients against the recompute route's and fp64, one flex forward per fwd + bwd instead of two,
the recompute route under ``model.recompute`` selective and full (the checkpoint's saved-tensor hooks), no tensor
held beyond what the non-selective path saves, and the graph released after a compact (Collider) backward.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from test_doc_flex import flex_inputs
from test_document_attention import EOD, kept_rows, reference, rel

from megasparse.ops import doc_flex, recompute
from megasparse.ops.attention import attention
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans

if not doc_flex.available():
    pytest.skip("this torch has no FlexAttention", allow_module_level=True)

SHAPES = [(200, 3, 4, 2, 8), (37, 2, 6, 2, 16), (11, 1, 3, 3, 8)]  # odd lengths, GQA 2:1 and 3:1, MHA


@pytest.fixture
def flex_calls(monkeypatch):
    """flex's backward on CPU (``test_doc_flex.flex_backward_on_cpu``), and a count of flex forward runs (every
    route runs ``doc_flex._flex``) and of kept graphs."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(doc_flex, "has_backward", lambda q: True)
    calls = {"flex": 0, "graph": 0}
    for name, key in (("_flex", "flex"), ("flex_forward_graph", "graph")):
        fn = getattr(doc_flex, name)

        def counted(*a, fn=fn, key=key):
            calls[key] += 1
            return fn(*a)

        monkeypatch.setattr(doc_flex, name, counted)
    return calls


def _grad(shape, recompute_mode: str = "none", seed: int = 0):
    """(y, dqkv) of one fp32 attention fwd + bwd under ``recompute_mode`` as ``model/gpt.py`` passes it."""
    s, b, nq, nkv, d = shape
    qkv, gout, (cos, sin), ids = flex_inputs(shape, seed)
    x = qkv.float().requires_grad_()
    docs = DocSpans.from_ids(ids, EOD, "flex")

    def layer(x):
        return attention(x, nq, nkv, cos, sin, recompute_mode == "selective", docs=docs, keep_graph=False)

    if recompute_mode == "full":  # the layer under the checkpoint, keep_graph left on: the hook check must catch it
        y = recompute.full(lambda x: attention(x, nq, nkv, cos, sin, docs=docs), x)
    elif recompute_mode == "keep_graph_off":
        y = layer(x)
    else:
        y = attention(x, nq, nkv, cos, sin, recompute_mode == "selective", docs=docs)
    y.backward(gout.float())
    return y, x.grad, (qkv, gout, ids)


@pytest.mark.parametrize("shape", SHAPES)
def test_kept_graph_equals_recompute_route_and_fp64(shape, flex_calls):
    y, got, (qkv, gout, ids) = _grad(shape)
    assert flex_calls == {"flex": 1, "graph": 1}  # one flex forward for the fwd + bwd
    _, want, _ = _grad(shape, "keep_graph_off")
    assert flex_calls == {"flex": 3, "graph": 1}  # the recompute route: two more
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    s, b, nq, nkv, d = shape
    xr = qkv.clone().requires_grad_()
    reference(xr, ids, nq, nkv).backward(gout)
    assert rel(got, xr.grad) < 1e-5 and rel(y, reference(qkv, ids, nq, nkv)) < 1e-5


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_the_recompute_route(mode, flex_calls):
    """selective saves qkv, y, lse only (the graph would hold the rotated q, k too); full runs the layer inside the
    non-reentrant checkpoint, whose saved-tensor hooks the graph would escape: both rerun flex in the backward."""
    _, got, (qkv, gout, ids) = _grad(SHAPES[1], mode)
    assert flex_calls["graph"] == 0
    assert flex_calls["flex"] == (2 if mode == "selective" else 3)  # full: the checkpoint's rerun of the layer too
    _, want, _ = _grad(SHAPES[1])
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_no_graph_without_a_gradient(flex_calls):
    qkv, _, (cos, sin), ids = flex_inputs(SHAPES[1])
    docs = DocSpans.from_ids(ids, EOD, "flex")
    attention(qkv.float(), 6, 2, cos, sin, docs=docs)  # no input requires grad
    with torch.no_grad():
        attention(qkv.float().requires_grad_(), 6, 2, cos, sin, docs=docs)
    assert flex_calls == {"flex": 2, "graph": 0}


def _storages(ts) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts if isinstance(t, torch.Tensor)}


def test_kept_graph_holds_no_copy(flex_calls):
    """The graph's saved tensors are the storages the non-selective path saves anyway (the rotated q/k buffer, the
    input's v, the output that y is a view of) and the micro-batch's memoised block mask and segment table; new are
    only [b, h, s] fp32 rows: flex's own (log2) lse and, in the eager CPU op only, its row maxima."""
    s, b, nq, nkv, d = SHAPES[0]
    qkv, _, (cos, sin), ids = flex_inputs(SHAPES[0])
    x = qkv.float().requires_grad_()
    docs = DocSpans.from_ids(ids, EOD, "flex")
    y = attention(x, nq, nkv, cos, sin, docs=docs)
    leaves, out_graph = y.grad_fn.graph
    held = [*leaves, out_graph, *out_graph.grad_fn.saved_tensors]
    mask = doc_flex.block_mask(docs, x.device)
    segments = [c.cell_contents for c in mask.mask_mod.__closure__]
    known = _storages(y.grad_fn.saved_tensors) | _storages([x, y, *segments]) | _storages(mask.as_tuple())
    new = [t for t in held if t.untyped_storage().data_ptr() not in known]
    assert out_graph.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert len(held) > 5 and len(new) == 2 and all(t.shape == (b, nq, s) for t in new), [t.shape for t in new]


@pytest.mark.parametrize("compact", [False, True])
def test_graph_released_after_backward(compact, flex_calls):
    """The dense backward consumes the kept graph; the compact one (the bias kernel with the forward's out and lse:
    it needs the full softmax's lse, decision 1201) drops it. Either way nothing of it stays alive."""
    shape = SHAPES[0]
    s, b, nq, nkv, d = shape
    qkv, gout, (cos, sin), ids = flex_inputs(shape, seed=1)
    x = qkv.float().requires_grad_()
    y = attention(x, nq, nkv, cos, sin, docs=DocSpans.from_ids(ids, EOD, "flex"))
    alive = [weakref.ref(t) for t in (*y.grad_fn.graph[0], y.grad_fn.graph[1])]
    keep = torch.ones(s, b, dtype=torch.bool)
    if compact:
        counts = [50, 90, 20]
        idx = kept_rows(s, b, counts, torch.Generator().manual_seed(2))
        y.backward(CompactGrad(gout.reshape(s * b, -1)[idx].float(), KeepMeta(idx, s * b, batch=b), y.shape))
        keep = torch.zeros(s * b, dtype=torch.bool)
        keep[idx] = True
        keep = keep.view(s, b)
        got, want_rows = x.grad.rows, idx
    else:
        y.backward(gout.float())
        got, want_rows = x.grad.reshape(s * b, -1), torch.arange(s * b)
    assert y.grad_fn.graph is None and all(w() is None for w in alive)
    assert flex_calls == {"flex": 1, "graph": 1}
    xr = qkv.clone().requires_grad_()
    reference(xr, ids, nq, nkv, keep if compact else None).backward(gout * keep[..., None])
    assert rel(got, xr.grad.reshape(s * b, -1)[want_rows]) < 1e-5
