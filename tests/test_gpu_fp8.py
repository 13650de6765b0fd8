"""GPU: the fp8 GEMMs (megasparse/fp8/, decision 1000) on sm_89+: the Triton casts give the reference's bits, the
``torch._scaled_mm`` products equal the CPU emulation to the output dtype's rounding, a captured step with
train.fp8 trains like the eager one, and fp8 adds no host synchronisation to a step."""

from __future__ import annotations

import pytest
import torch
from test_gpu_cudagraph import one_rank  # noqa: F401 - the module's one-rank NCCL group fixture
from test_gpu_sync import _syncs
from tiny import TRAINING, tiny

from megasparse.fp8.cast import E4M3, E5M2, quantize, quantize_reference
from megasparse.fp8.gemm import Fp8Gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 GEMMs (sm_89+)"
    ),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("axis", ["tensor", "row", "col"])
def test_triton_cast_equals_reference_bitwise(fmt, axis) -> None:
    x = (torch.randn(2458, 1000, device="cuda") * torch.logspace(-4, 3, 1000, device="cuda")).to(torch.bfloat16)
    for transpose in (False, True):
        q, s = quantize(x, fmt, axis, transpose=transpose, pad_to=2464 if transpose else None)
        qr, sr = quantize_reference(x.cpu(), fmt, axis, transpose=transpose, pad_to=2464 if transpose else None)
        assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("n,k,t", [(384, 256, 4096), (384, 256, 2458), (1024, 512, 37)])
def test_scaled_mm_equals_emulation(recipe: str, n: int, k: int, t: int) -> None:
    """Same fp8 values and scales on both sides: the products differ only by accumulation order and the output's
    rounding (bf16: 2⁻⁹ relative per value; the fp32 weight gradient: fp32 accumulation)."""
    g = torch.Generator(device="cuda").manual_seed(n + t)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = (torch.randn(t, n, device="cuda", generator=g) * 1e-4).to(torch.bfloat16)
    gpu = Fp8Gemm(w, recipe, wgrad_fp8=True)  # the fp8 weight gradient (the bf16 one is accumulate_mm, as without fp8)
    cpu = Fp8Gemm(torch.nn.Parameter(w.detach().cpu()), recipe, wgrad_fp8=True)
    w8, w8c = gpu.operand(), cpu.operand()
    assert torch.equal(w8.cpu().view(torch.uint8), w8c.view(torch.uint8))
    assert torch.equal(gpu.w8t.cpu().view(torch.uint8), cpu.w8t.view(torch.uint8))
    y, yc = gpu.fwd(x, w8), cpu.fwd(x.cpu(), w8c)
    dx, dxc = gpu.dgrad(dy, w8), cpu.dgrad(dy.cpu(), w8c)
    assert y.dtype == dx.dtype == torch.bfloat16
    assert rel(y, yc) < 5e-3 and rel(dx, dxc) < 5e-3, (rel(y, yc), rel(dx, dxc))
    out, outc = torch.zeros(n, k, device="cuda"), torch.zeros(n, k)
    gpu.wgrad_into(dy, x, out)
    cpu.wgrad_into(dy.cpu(), x.cpu(), outc)
    # fp32 out / bf16 out (the rowwise kernels' wide output); Hopper's fp8 MMAs accumulate with fewer than fp32's
    # mantissa bits between their periodic fp32 promotions, so over 2458-4096 tokens fp32 out lands ~1.03e-4 away
    tol = 3e-4 if recipe == "tensorwise" else 5e-3
    assert rel(out, outc) < tol, rel(out, outc)


BASE = tiny(**TRAINING, model__num_layers=2, train__device="cuda", train__dtype="bf16", model__seq_length=256) + [
    "train.fp8_min_mnk=0"  # the tiny GEMMs run fp8 too
]
COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]  # 154 kept rows: padded to 160


def _trainer(overrides: list[str]):
    from megasparse.config import load_config
    from megasparse.train import Trainer

    return Trainer(load_config(None, BASE + ["parallel.backend=nccl"] + overrides), init_groups=False)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["dense", "collider"])
def test_captured_fp8_step_equals_eager(fp8: str, mode: str) -> None:
    """The fp8 weight copies are refreshed in place after each optimizer step, outside the graph, and the casts'
    scales are computed on the device: replaying the captured micro-batch trains like the eager step."""
    ov = [f"train.fp8={fp8}"] + (COLLIDER if mode == "collider" else [])
    runs = {}
    for graphs in (False, True):
        tr = _trainer(ov + [f"train.cuda_graphs={str(graphs).lower()}"])
        res = [tr.train_step() for _ in range(4)]
        assert tr.graphs.active == graphs and len(tr.fp8.gemms) == 8
        runs[graphs] = [r.loss for r in res] + [r.grad_norm for r in res]
        del tr
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    for a, b in zip(runs[True], runs[False]):
        assert a == pytest.approx(b, rel=2e-3), runs


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("mode", ["dense", "collider"])
def test_fp8_adds_no_host_syncs(mode: str) -> None:
    """A step's forward + backward with fp8 (test_gpu_sync's count): the casts read no device value on the host."""
    ov = (COLLIDER if mode == "collider" else []) + ["train.cuda_graphs=false"]  # count the eager casts
    base = _syncs(ov)
    for fp8 in ("tensorwise", "rowwise"):
        assert _syncs(ov + [f"train.fp8={fp8}"]) <= base, fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis", ["tensor", "row", "col"])
def test_masked_cast_equals_cast_of_the_product(dtype, axis) -> None:
    """Decision 1235: a 2:4 weight's fp8 copies from W and M (no W ⊙ M made) have the bits of the casts of W * M, on
    the GPU and against the CPU reference; fp32 takes the torch transpose (decision 1001's sm_90 finding)."""
    from megasparse.fp8.cast import quantize_triton
    from megasparse.sparse24.masks import transposable_mask

    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(1000, 772, device="cuda", generator=g) * torch.logspace(-3, 2, 772, device="cuda")).to(dtype)
    m = transposable_mask(w)
    for fmt in (E4M3, E5M2):
        q, qt, s = quantize_triton(w, fmt, axis, transpose=True, pad_to=1008, mask=m)
        q_ref, qt_ref, s_ref = quantize_triton(w * m, fmt, axis, transpose=True, pad_to=1008)
        cq, cs = quantize_reference((w * m).cpu(), fmt, axis)
        for a, b in ((q, q_ref), (qt, qt_ref), (q, cq)):
            assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)), (fmt, axis, dtype)
        assert torch.equal(s, s_ref) and torch.equal(s.cpu(), cs)


@pytest.mark.usefixtures("one_rank")
def test_2to4_under_fp8_builds_no_sparse_operands() -> None:
    """Decision 1235, in the 8B runs' layout (bf16 parameters under the distributed optimizer, cuSPARSELt-aligned
    FFNs): without fp8 the 2:4 steps pack cuSPARSELt operands; with fp8 no Sparse24Weight exists for the layers fp8
    runs, nothing is packed, and the GEMM autotune times nothing."""
    import gc

    from megasparse.sparse24.linear import Sparse24Weight

    ov = ["sparsity.enabled=true", "model.hidden_size=128", "model.ffn_hidden_size=256", "train.steps=12"]
    ov += ["parallel.distributed_optimizer=true", "train.cuda_graphs=false"]
    for fp8 in ("tensorwise", "off"):
        tr = _trainer(ov + [f"train.fp8={fp8}"])
        losses = [tr.train_step().loss for _ in range(3)]
        gemms, tune = tr.sparsity.gemms, tr.sparsity.autotune
        ptrs = {g.param.data_ptr() for g in gemms}  # this trainer's (a state's weight is its bf16 parameter)
        packed = [
            o
            for o in gc.get_objects()
            if isinstance(o, Sparse24Weight) and o.packed is not None and o._w.data_ptr() in ptrs
        ]
        assert all(torch.isfinite(torch.tensor(losses))) and {g.param.dtype for g in gemms} == {torch.bfloat16}
        if fp8 == "off":
            assert len(packed) == len(gemms) and tune.times[True]  # the control: these shapes build cuSPARSELt operands
        else:
            assert not packed and all(g.fp8 is not None and not g.tunable for g in gemms)
            assert tune.choice is False and tune.times == {True: [], False: []}
        del tr, packed
        gc.collect()
