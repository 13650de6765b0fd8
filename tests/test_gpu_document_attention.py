"""GPU paths of document-aware attention (decisions 1200, 1201): the bias kernels (cuDNN, memory-efficient) and
FlexAttention (compiled; its dense backward by a recomputed forward, the compact backward by the bias kernels)
forward, dense and compact backward against the fp64 reference, and the spans and block mask computed inside a
captured CUDA graph."""

from __future__ import annotations

import pytest
import torch
from test_document_attention import EOD, kept_rows, reference
from test_gpu_cudagraph import one_rank  # noqa: F401 - the one-rank NCCL group fixture

from megasparse.ops import attention as attn
from megasparse.ops import doc_flex
from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans, reference_attention

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

S, B, NQ, NKV, D = 1000, 3, 8, 2, 64  # s not a multiple of 8: the bias rows are padded for the kernels
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
KERNELS = ["bias", "flex"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def window(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv, output gradient (fp64, CPU) and ids [S, B]: many documents in sequence 0, none in 1, EOD last in 2."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, B, (NQ + 2 * NKV) * D, generator=gen, dtype=torch.float64)
    gout = torch.randn(S, B, NQ * D, generator=gen, dtype=torch.float64)
    ids = torch.randint(10, 50, (S, B), generator=gen)
    ids[torch.randperm(S, generator=gen)[:12], 0] = EOD
    ids[[0, 300, S - 1], 2] = EOD
    return qkv, gout, ids


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_matches_reference(dtype, kernel):
    qkv, gout, ids = window(0)
    cos, sin = rope_tables(S, D, 10000.0, "cuda")
    x = qkv.to("cuda", dtype).requires_grad_()
    y = attention(x, NQ, NKV, cos, sin, docs=DocSpans.from_ids(ids.cuda(), EOD, kernel))
    y.backward(gout.to("cuda", dtype))
    xr = qkv.to(dtype).double().requires_grad_()  # the reference from the same rounded inputs
    yr = reference(xr, ids, NQ, NKV)
    yr.backward(gout.to(dtype).double())
    assert rel(y, yr) < TOL[dtype] and rel(x.grad, xr.grad) < TOL[dtype]


def test_bf16_runs_cudnn_with_the_bias_on_hopper():
    """The fast kernel is the one that ran: a failure here means cuDNN refused the bias (the memory-efficient
    kernel then ran, correct but slower: the warning names the reason)."""
    test_dense_matches_reference(torch.bfloat16, "bias")
    if torch.cuda.get_device_capability()[0] >= 9:
        assert attn._CUDNN_BIAS["ok"] and attn._CUDNN["ok"]


def test_flex_runs_compiled():
    """FlexAttention ran (a failure here: a flex call failed and the bias took over; the warning says why)."""
    test_dense_matches_reference(torch.bfloat16, "flex")
    assert doc_flex._OK["ok"] and "cuda" in doc_flex._FN


def test_flex_at_4096_matches_fp64():
    """The compiled kernel at a training length (s = 4096, head dim 128, GQA 4:1): forward, natural-log lse and the
    recomputed backward against fp64; many documents in one sequence, one document in the other."""
    s, b, nq, nkv, d = 4096, 2, 8, 2, 128
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(10, 50, (s, b), generator=gen)
    ids[torch.randperm(s, generator=gen)[:20], 0] = EOD
    docs = DocSpans.from_ids(ids.cuda(), EOD, "flex")
    q, k, v = (torch.randn(b, h, s, d, generator=gen).cuda().bfloat16() for h in (nq, nkv, nkv))
    g = torch.randn(b, nq, s, d, generator=gen).cuda().bfloat16()
    out, lse = doc_flex.flex_forward(q, k, v, docs, d**-0.5)
    dq, dk, dv = doc_flex.flex_backward(g, q, k, v, docs, d**-0.5)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    allowed = docs.allowed()
    ref = reference_attention(qr, kr, vr, allowed, d**-0.5)
    ref.backward(g.double())
    with torch.no_grad():
        scores = (qr @ kr.repeat_interleave(nq // nkv, 1).transpose(-1, -2)) * d**-0.5
        ref_lse = scores.masked_fill_(~allowed, float("-inf")).logsumexp(-1)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2  # natural log (base 2 would be off by ×1.44)
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel(got, want) < TOL[torch.bfloat16]
    assert doc_flex._OK["ok"]


def _flex_counts(monkeypatch) -> dict[str, int]:
    """Counts of flex forward runs (``_flex``: every route), kept graphs and recomputed-flex backwards."""
    calls = {"_flex": 0, "flex_forward_graph": 0, "flex_backward": 0}
    for name in calls:
        fn = getattr(doc_flex, name)

        def counted(*a, fn=fn, name=name):
            calls[name] += 1
            return fn(*a)

        monkeypatch.setattr(doc_flex, name, counted)
    return calls


def test_flex_kept_graph_at_4096(monkeypatch):
    """Decision 1202 at a training length (s = 4096, bf16, head dim 128, GQA 4:1): the dense backward through the
    forward's kept graph runs one flex forward per fwd + bwd (the recompute route two), gives the recompute route's
    gradients, and holds no copy of q, k, v or the output (y is a view of flex's output; what the forward leaves
    allocated exceeds the recompute route's by at most a few [b, h, s] fp32 rows: flex's own lse)."""
    s, b, nq, nkv, d = 4096, 2, 8, 2, 128
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(10, 50, (s, b), generator=gen)
    ids[torch.randperm(s, generator=gen)[:20], 0] = EOD
    docs = DocSpans.from_ids(ids.cuda(), EOD, "flex")
    cos, sin = rope_tables(s, d, 10000.0, "cuda")
    x = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen).cuda().bfloat16().requires_grad_()
    gout = torch.randn(s, b, nq * d, generator=gen).cuda().bfloat16()

    def step(keep_graph: bool):
        x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = attention(x, nq, nkv, cos, sin, docs=docs, keep_graph=keep_graph)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before  # what the forward leaves for the backward, y included
        kept = y.grad_fn.graph
        same = kept is not None and kept[1].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        del kept
        y.backward(gout)
        return x.grad.clone(), held, same

    for keep_graph in (True, False):  # compile and warm up both routes (and the block mask)
        step(keep_graph)
    calls = _flex_counts(monkeypatch)
    g_graph, held_graph, same = step(True)
    assert calls == {"_flex": 1, "flex_forward_graph": 1, "flex_backward": 0}, calls
    g_recompute, held_recompute, _ = step(False)
    assert calls == {"_flex": 3, "flex_forward_graph": 1, "flex_backward": 1}, calls
    assert same, "y is a copy of flex's output: the kept graph holds a second output"
    assert held_graph - held_recompute <= 4 * b * nq * s * 4, (held_graph, held_recompute)
    assert rel(g_graph, g_recompute.double()) < 1e-2
    assert doc_flex._OK["ok"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
def test_compact_backward_matches_collider_reference(dtype, static, kernel):
    qkv, gout, ids = window(1)
    cos, sin = rope_tables(S, D, 10000.0, "cuda")
    counts = [400] * B if static else [400, 700, 123]
    idx = kept_rows(S, B, counts, torch.Generator().manual_seed(2))
    meta = KeepMeta(idx.cuda(), S * B, batch=B, seq_count=counts[0] if static else None)
    x = qkv.to("cuda", dtype).requires_grad_()
    y = attention(x, NQ, NKV, cos, sin, docs=DocSpans.from_ids(ids.cuda(), EOD, kernel))
    y.backward(CompactGrad(gout.reshape(S * B, -1)[idx].to("cuda", dtype), meta, y.shape))
    keep = torch.zeros(S * B, dtype=torch.bool)
    keep[idx] = True
    keep = keep.view(S, B)
    xr = qkv.to(dtype).double().requires_grad_()
    reference(xr, ids, NQ, NKV, keep).backward(gout.to(dtype).double() * keep[..., None])
    assert rel(x.grad.rows, xr.grad.reshape(S * B, -1)[idx]) < TOL[dtype]


@pytest.mark.parametrize("kernel", KERNELS)
def test_spans_and_attention_replay_in_a_cuda_graph(kernel):
    """Spans (and flex's block mask) built inside the capture from a static ids buffer follow new ids on replay (no
    host sync)."""
    _, _, ids = window(2)
    qkv = torch.randn(S, B, (NQ + 2 * NKV) * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(S, D, 10000.0, "cuda")
    static = ids.cuda()
    gout = torch.randn(S, B, NQ * D, device="cuda", dtype=torch.bfloat16)

    def run():
        qkv.grad = None
        y = attention(qkv, NQ, NKV, cos, sin, docs=DocSpans.from_ids(static, EOD, kernel))
        y.backward(gout)
        return y.detach(), qkv.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    qkv.grad = None
    with torch.cuda.graph(graph):
        y_static, g_static = run()
    other = ids.clone()
    other[[5, 77, 500], 1] = EOD  # new documents in the sequence that had none
    static.copy_(other.cuda())
    graph.replay()
    torch.cuda.synchronize()
    y_eager, g_eager = run()
    # cuDNN's backward accumulates dq with atomics (not bitwise reproducible): compare at bf16 rounding, and check
    # the replay did follow the new ids (stale spans would leave sequence 1 one document)
    assert rel(y_static, y_eager) < 1e-2 and rel(g_static, g_eager) < 1e-2
    static.copy_(ids.cuda())
    y_old, _ = run()
    assert rel(y_old[:, 1], y_eager[:, 1]) > 1e-1
    assert kernel == "bias" or doc_flex._OK["ok"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["dense", "collider", "dense-full"])
@pytest.mark.usefixtures("one_rank")
def test_captured_step_equals_eager(mode: str, kernel: str, monkeypatch) -> None:
    """train.cuda_graphs with document attention: the spans are rebuilt from the static ids on every replay, so the
    captured step trains like the eager one (and unlike the step without documents). With flex the forward's kept
    graph feeds the dense backward inside the capture (decision 1202); under ``model.recompute=full`` the backward
    reruns the flex forward instead."""
    from test_document_attention import packed_documents
    from test_gpu_cudagraph import _losses

    ov = ["data.prefix=packed-documents", "data.document_attention=true", "train.micro_batch_size=2"]
    ov += [f"data.document_attention_kernel={kernel}"]
    if mode == "collider":
        ov += ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]
    if mode == "dense-full":
        ov += ["model.recompute=full"]
    calls = _flex_counts(monkeypatch)
    with packed_documents():
        eager_l, eager_g, used = _losses(ov + ["train.cuda_graphs=false"])
        assert not used
        graph_l, graph_g, used = _losses(ov + ["train.cuda_graphs=true"])
        assert used, "the step with document attention was not captured"
        plain_l, plain_g, _ = _losses(ov + ["train.cuda_graphs=false", "data.document_attention=false"])
    assert graph_l[0] == pytest.approx(eager_l[0], rel=1e-6)
    for a, b in zip(graph_l + graph_g, eager_l + eager_g):
        assert a == pytest.approx(b, rel=2e-3), (graph_l, eager_l, graph_g, eager_g)
    moved = max(abs(a - b) / abs(b) for a, b in zip(plain_l + plain_g, eager_l + eager_g))
    assert moved > 1e-4, "the documents changed nothing"
    assert kernel == "bias" or doc_flex._OK["ok"], "flex failed: the bias path ran instead"
    if kernel == "flex" and mode == "dense-full":
        assert calls["flex_forward_graph"] == 0 and calls["flex_backward"] > 0, calls
    elif kernel == "flex":
        assert calls["flex_forward_graph"] > 0 and calls["flex_backward"] == 0, calls
