"""GPU: activation recompute (``model.recompute``, decision 0012) inside a captured step equals the eager step, and
equals no recompute, dense and with Collider's compact backward."""

from __future__ import annotations

import pytest
import torch
from test_gpu_cudagraph import _losses, one_rank  # noqa: F401 - the module's one-rank NCCL group fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["dense", "collider"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.usefixtures("one_rank")
def test_captured_recompute_equals_eager(mode: str, recompute: str) -> None:
    from megasparse.ops.compact import densify_count

    ov = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"] if mode == "collider" else []
    base_l, base_g, _ = _losses(ov + ["train.cuda_graphs=false"])
    before = densify_count()
    eager_l, eager_g, used = _losses(ov + ["train.cuda_graphs=false", f"model.recompute={recompute}"])
    assert not used
    graph_l, graph_g, used = _losses(ov + ["train.cuda_graphs=true", f"model.recompute={recompute}"])
    assert used, "the step with recompute was not captured"
    assert densify_count() == before
    assert eager_l[0] == pytest.approx(base_l[0], rel=1e-6), "recompute changed the forward"
    for a, b in zip(eager_l + eager_g, base_l + base_g):  # attention's backward may add in any order: not bitwise
        assert a == pytest.approx(b, rel=2e-3), ("recompute changed the eager step", eager_l, base_l, eager_g, base_g)
    assert graph_l[0] == pytest.approx(eager_l[0], rel=1e-6)
    for a, b in zip(graph_l + graph_g, eager_l + eager_g):
        assert a == pytest.approx(b, rel=2e-3), (graph_l, eager_l, graph_g, eager_g)


@pytest.mark.parametrize("compact", [False, True])
def test_attention_recompute_same_gradient_cudnn(compact: bool) -> None:
    """Selective recompute's attention (q/k rotated again, the output read back through the projection's view of
    it) gives the kernel the operands it saw without recompute: the same gradient, dense and compact."""
    from megasparse.ops.attention import attention, rope_tables
    from megasparse.ops.compact import CompactGrad, KeepMeta

    torch.manual_seed(3)
    s, b, nq, nkv, d = 512, 2, 8, 2, 128
    cos, sin = rope_tables(s, d, 10000.0, "cuda")
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, device="cuda", dtype=torch.bfloat16)
    n = s * b
    keep = torch.arange(0, n, 2, device="cuda")  # static: every sequence keeps s/2 rows
    g = torch.randn(s, b, nq * d, device="cuda", dtype=torch.bfloat16)

    def grad(recompute: bool) -> torch.Tensor:
        x = qkv.clone().requires_grad_()
        out = attention(x, nq, nkv, cos, sin, recompute)
        if compact:
            meta = KeepMeta(keep, n, b, seq_count=s // 2)
            out.backward(CompactGrad(g.reshape(n, -1)[keep], meta, out.shape))
        else:
            out.backward(g)
        gx = x.grad
        return gx.rows if isinstance(gx, CompactGrad) else gx.reshape(n, -1)[keep] if compact else gx

    a, r = grad(False), grad(True)
    assert ((a.float() - r.float()).norm() / a.float().norm()).item() < 1e-2
