"""The fused 2:4 optimizer step (sparse24/optim.py): its reference is torch's AdamW on the masked-decayed gradient,
its Triton kernel (TRITON_INTERPRET=1 on CPU, compiled on a GPU) matches the reference, and a GPU run with it trains
like the run without it. The unfused path's masked-decay pass (sparse24/decay.py) matches its torch reference."""

from __future__ import annotations

import pytest
import torch
from interpret import check_under_interpreter, needs_interpreter

from megasparse.sparse24.optim import masked_adamw_reference

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decay=2e-2)


def _inputs(n: int, device: str = "cpu", dtype=torch.float64):
    g = torch.Generator(device=device).manual_seed(n)
    p = torch.randn(n, generator=g, device=device, dtype=dtype)
    grads = [torch.randn(n, generator=g, device=device, dtype=dtype) for _ in range(3)]
    mask = torch.rand(n, generator=g, device=device) < 0.5
    return p, grads, mask


def test_reference_is_torch_adamw_on_the_masked_decayed_gradient():
    p, grads, mask = _inputs(1001)
    h = HYPER
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW(
        [ref], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"]
    )
    mine, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        ref.grad = g + h["decay"] * ref.detach() * ~mask  # what SparsityManager.apply_masked_decay adds
        opt.step()
        masked_adamw_reference(mine, g, m, v, mask, step, **{k: h[k] for k in ("lr", "beta1", "beta2", "eps")},
                               weight_decay=h["weight_decay"], decay=h["decay"])  # fmt: skip
        torch.testing.assert_close(mine, ref.detach(), rtol=1e-12, atol=1e-12)
    assert not torch.equal(mine, p)


def _check(device: str = "cpu") -> None:
    """Both kernels (the interpreter runs this once: one subprocess)."""
    _check_adamw(device)
    _check_decay(device)


def _check_decay(device: str = "cpu") -> None:
    from megasparse.sparse24.decay import masked_decay_reference, masked_decay_triton

    lam = 2e-2
    for n in (1, 777, 4097, 9001):
        for wdt in (torch.bfloat16, torch.float32):
            gen = torch.Generator(device=device).manual_seed(n)
            full = torch.randn(n + 5, generator=gen, device=device)
            w = torch.randn(n, generator=gen, device=device).to(wdt)
            mask = torch.rand(n, generator=gen, device=device) < 0.5
            before = full.clone()
            g0 = before[3 : 3 + n]  # an odd offset into a larger buffer, like a DP rank's owned chunk
            want = g0.double() + lam * w.double() * (~mask).double()
            masked_decay_triton(full[3 : 3 + n], w, mask, lam)
            got = full[3 : 3 + n]
            bound = 2**-22 * (g0.double().abs() + lam * w.double().abs()) + 1e-30
            assert ((got.double() - want).abs() <= bound).all(), (n, wdt)
            assert torch.equal(got[mask], g0[mask])  # kept entries untouched
            assert torch.equal(got, g0) == bool(mask.all())  # and a pruned entry changed (n = 1 may keep its one)
            assert torch.equal(full[:3], before[:3]) and torch.equal(full[3 + n :], before[3 + n :])  # only the slice
            ref = g0.clone()
            masked_decay_reference(ref, w, mask, lam)
            if device == "cpu":  # the interpreter rounds like torch's CPU addcmul_: bit for bit
                assert torch.equal(got, ref), (n, wdt)
            else:  # a CUDA addcmul_ may fuse the multiply into the add: within a rounding
                assert ((got - ref).abs() <= 2**-23 * (ref.abs() + lam * w.float().abs())).all(), (n, wdt)
    with pytest.raises(ValueError, match="bool M"):
        masked_decay_triton(torch.zeros(4, device=device), torch.zeros(4, device=device), torch.ones(4), lam)


def _check_adamw(device: str = "cpu") -> None:
    from megasparse.sparse24.optim import masked_adamw_

    for n in (1, 777, 5000):
        p64, grads, mask = _inputs(n, device)
        p, m, v = p64.float(), torch.zeros(n, device=device), torch.zeros(n, device=device)
        rp, rm, rv = p64.clone(), torch.zeros_like(p64), torch.zeros_like(p64)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        for step, g in enumerate(grads, start=1):
            masked_adamw_(p, g.float(), m, v, mask, step, **HYPER, out=out)
            masked_adamw_reference(rp, g, rm, rv, mask, step, **HYPER)
            for got, want in ((p, rp), (m, rm), (v, rv)):
                err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
                assert err < 1e-5, (n, step, err)
            if device == "cuda":  # the compute copy is the updated weight, rounded to nearest like torch's cast
                assert torch.equal(out, p.to(torch.bfloat16))
            else:  # the interpreter's cast truncates: within one bf16 step
                assert ((out.float() - p).abs() <= 2**-7 * p.abs()).all()
        # the 2:4 GEMMs' operand: the updated weight times the mask, pruned entries exactly zero
        masked = torch.empty(n, dtype=torch.bfloat16, device=device)
        masked_adamw_(p.clone(), grads[0].float(), m.clone(), v.clone(), mask, 4, **HYPER, out=masked, mask_out=True)
        masked_adamw_(p, grads[0].float(), m, v, mask, 4, **HYPER, out=out)
        assert torch.equal(masked, out * mask) and not masked[~mask].any()


@needs_interpreter
def test_kernel_matches_reference_under_interpreter() -> None:
    check_under_interpreter("test_sparse24_optim")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu() -> None:
    _check_adamw("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decay_kernel_on_gpu_matches_reference_and_allocates_nothing() -> None:
    from megasparse.sparse24.decay import masked_decay_

    _check_decay("cuda")
    n = 1 << 24  # the torch reference's ~M alone would be 16 MiB
    g, w = torch.randn(n, device="cuda"), torch.randn(n, device="cuda").bfloat16()
    mask = torch.rand(n, device="cuda") < 0.5
    masked_decay_(g, w, mask, 1e-2)  # compiled before the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    masked_decay_(g, w, mask, 1e-2)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < n // 8


def _train(fused: bool, sharded: bool = False) -> dict:
    from tiny import TRAINING, tiny

    from megasparse.config import load_config
    from megasparse.parallel import state
    from megasparse.sparse24 import optim
    from megasparse.train import Trainer

    cls = optim.FusedMaskedAdamW
    saved = cls.__dict__["usable"], cls.__dict__["_step_pieces"]  # run_distributed(.., 1, ..) runs in this process
    if not fused:
        cls.usable = staticmethod(lambda opt: False)
        cls._step_pieces = lambda self, opt: False
    try:
        state.init(1, 1, False, "nccl")
        base = tiny(model__num_layers=2, train__device="cuda", train__dtype="bf16", model__seq_length=256, **TRAINING)
        ov = ["parallel.backend=nccl", "model.hidden_size=128", "model.ffn_hidden_size=256", "train.steps=12",
              "sparsity.enabled=true", "sparsity.refresh_interval=3", "sparsity.decay=1e-2",
              f"parallel.distributed_optimizer={str(sharded).lower()}"]  # fmt: skip
        tr = Trainer(load_config(None, base + ov), init_groups=False)
        taken = []
        if sharded:  # count the steps that lent the 2:4 weights' pieces to the fused kernel
            lend = tr.optimizer.take_pieces
            tr.optimizer.take_pieces = lambda wanted: taken.append(1) or lend(wanted)
        losses = [tr.train_step().loss]
        if sharded:  # the fp32 masters (the bf16 parameters round away a one-rounding difference)
            w = {str(k): m.detach().cpu().clone() for k, m in enumerate(tr.optimizer.masters)}
        else:
            w = {n: p.detach().float().cpu() for n, p in tr.sparsity.manager.weights.items()}  # after one step
        losses += [tr.train_step().loss for _ in range(5)]
        took = bool(taken) if sharded else tr.sparsity.fused.steps is not None
        if sharded and fused:  # the pieces' fused step reads nothing back from the device
            tr.compute_gradients()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tr.sparsity.pre_optimizer_step(tr.optimizer)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert len(taken) == 7
            tr.optimizer.step()
        tr.graphs.release()
        return {"losses": losses, "took": took, "weights": w}
    finally:
        cls.usable, cls._step_pieces = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "distributed_optimizer"])
def test_fused_sparse_step_trains_like_decay_then_adamw(sharded: bool) -> None:
    """Replicated: the fused step on whole weights. Distributed optimizer (decision 1237): the fused step on the
    owned pieces, whose decay reads the fp32 master where the unfused path reads the bf16 parameter. Adam divides
    by √v + eps, so where |g| is near eps that rounding of the decay input moves a weight by a visible fraction of
    lr: 2.4e-5 of the masters' norm after one step in a CPU emulation of this test (bf16 parameters, the torch
    reference). Replicated, both read the same W and stay within 1e-6."""
    from distributed import run_distributed

    fused = run_distributed(_train, 1, True, sharded)[0]
    plain = run_distributed(_train, 1, False, sharded)[0]
    assert fused["took"] and not plain["took"]
    # later steps see bf16 forwards of weights that differ in the last fp32 bits: close, not equal
    assert fused["losses"] == pytest.approx(plain["losses"], rel=2e-3)
    for k, w in fused["weights"].items():  # one step from the same gradients: fp32 rounding apart
        assert ((w - plain["weights"][k]).norm() / w.norm()).item() < (1e-4 if sharded else 1e-6), k


def test_bench_sharded_sparse_step_smoke(capsys) -> None:
    """The CPU run of the benchmark the lead runs on a GPU: both ways step the same pieces to within a rounding."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_sharded_sparse_step import main

    res = main(["--device", "cpu", "--layers", "1", "--hidden", "16", "--ffn", "32", "--dp", "2", "--reps", "1"])
    assert res["elements"] == (2 * 32 * 16 + 16 * 32) // 2
    assert 0 < res["apart"] < 1e-5  # the two decay inputs (bf16 parameter, fp32 master) differ, by a rounding
    assert "fused masked_adamw_" in capsys.readouterr().out
