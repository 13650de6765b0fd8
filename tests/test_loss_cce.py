"""CCE loss on CPU (chunked torch path and the materialised path) against fp64 torch cross-entropy."""

from __future__ import annotations

import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.loss import LossConfig, shard_backward, shard_forward, vocab_order, vocab_parallel_loss


def ref_loss(h, w, t, vocab_size, softcap=None, z=0.0, ignore_index=-100):
    """Explicit fp64 per-token loss: lse − target logit + z·lse² (0 on ignored rows)."""
    lg = h.double() @ w[:vocab_size].double().T
    if softcap is not None:
        lg = softcap * torch.tanh(lg / softcap)
    lse = torch.logsumexp(lg, 1)
    valid = t != ignore_index
    tl = lg.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    return torch.where(valid, lse - tl + z * lse * lse, torch.zeros_like(lse))


def run(h, w, t, cfg, vocab_size, gout, **kw):
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    loss = vocab_parallel_loss(hh, ww, t, cfg, vocab_start=0, vocab_size=vocab_size, **kw)
    loss.backward(gout)
    return loss.detach(), hh.grad, ww.grad


def run_ref(h, w, t, vocab_size, gout, **kw):
    hh = h.detach().double().requires_grad_()
    ww = w.detach().double().requires_grad_()
    loss = ref_loss(hh, ww, t, vocab_size, **kw)
    loss.backward(gout.double())
    return loss.detach(), hh.grad, ww.grad


def inputs(n, v, d, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v + pad, d, generator=g) / d**0.5 * 3
    t = torch.randint(0, v, (n,), generator=g)
    gout = torch.rand(n, generator=g) + 0.5
    return h, w, t, gout


def close(a, b, tol):
    err = float((a.double() - b.double()).norm() / b.double().norm())
    assert err < tol, err


@pytest.mark.parametrize("impl", ["cce", "materialized"])
@pytest.mark.parametrize("n,d", [(67, 64), (45, 256)])
def test_matches_fp64_at_gpt2_vocab(impl, n, d):
    v = 50257
    h, w, t, gout = inputs(n, v, d, seed=n * d, pad=7)  # 7 padded rows: must never count
    w[v:] = 100.0  # padding that would dominate the lse if it leaked in
    cfg = LossConfig(impl=impl, filter_eps=None)
    loss, dh, dw = run(h, w, t, cfg, v, gout)
    rl, rdh, rdw = run_ref(h, w, t, v, gout)
    close(loss, rl, 1e-6)
    close(dh, rdh, 1e-5)
    close(dw[:v], rdw[:v], 1e-5)
    assert torch.all(dw[v:] == 0)


def test_exact_mode_bitwise_stable():
    h, w, t, gout = inputs(53, 3001, 96, seed=1)
    cfg = LossConfig(impl="cce", filter_eps=None, sort_vocab=True)
    a = run(h, w, t, cfg, 3001, gout)
    b = run(h, w, t, cfg, 3001, gout)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("impl", ["cce", "materialized"])
def test_ignore_index_rows(impl):
    h, w, t, gout = inputs(41, 997, 48, seed=2)
    t[[0, 5, 40]] = -100
    cfg = LossConfig(impl=impl, filter_eps=None)
    loss, dh, dw = run(h, w, t, cfg, 997, gout)
    rl, rdh, rdw = run_ref(h, w, t, 997, gout)
    assert torch.all(loss[[0, 5, 40]] == 0) and torch.all(dh[[0, 5, 40]] == 0)
    close(loss, rl, 1e-6)
    close(dh, rdh, 1e-5)
    close(dw, rdw, 1e-5)


@pytest.mark.parametrize("impl", ["cce", "materialized"])
def test_softcap_and_z_loss(impl):
    h, w, t, gout = inputs(39, 1531, 80, seed=3)
    h *= 4  # logits big enough for the cap to bend them
    cfg = LossConfig(impl=impl, filter_eps=None, softcap=5.0, z_loss=1e-2)
    loss, dh, dw = run(h, w, t, cfg, 1531, gout)
    rl, rdh, rdw = run_ref(h, w, t, 1531, gout, softcap=5.0, z=1e-2)
    close(loss, rl, 1e-6)
    close(dh, rdh, 1e-5)
    close(dw, rdw, 1e-5)


def test_sorting_same_result():
    h, w, t, gout = inputs(57, 4099, 64, seed=4)
    a = run(h, w, t, LossConfig(impl="cce", filter_eps=None, sort_vocab=False), 4099, gout)
    b = run(h, w, t, LossConfig(impl="cce", filter_eps=None, sort_vocab=True), 4099, gout)
    assert torch.equal(a[0], b[0])
    close(b[1], a[1], 1e-6)
    close(b[2], a[2], 1e-6)


def test_filtering_error_bounded_by_eps():
    """Each dropped softmax entry is < eps, so |dE_filtered − dE_exact| ≤ eps·|g|·Σ_j |C_j| elementwise."""
    h, w, t, gout = inputs(61, 2003, 32, seed=5)
    h *= 3  # peaky softmax: many entries fall under eps
    eps = 2.0**-12
    _, dh0, dw0 = run(h, w, t, LossConfig(impl="cce", filter_eps=None), 2003, gout)
    _, dh1, dw1 = run(h, w, t, LossConfig(impl="cce", filter_eps=eps), 2003, gout)
    bound = eps * gout[:, None] * w.abs().sum(0)[None, :]
    assert not torch.equal(dh0, dh1)  # something was actually filtered
    assert torch.all((dh1 - dh0).abs() <= bound + 1e-6)
    bound_c = eps * (gout[:, None] * h.abs()).sum(0)[None, :]
    assert torch.all((dw1 - dw0).abs() <= bound_c + 1e-6)


@pytest.mark.parametrize("impl", ["cce", "materialized"])
def test_keep_idx_only_kept_rows_get_gradient(impl):
    h, w, t, gout = inputs(30, 701, 40, seed=6)
    t[3] = -100
    keep = torch.tensor([1, 3, 4, 10, 17, 29])
    loss, dh, dw = run(h, w, t, LossConfig(impl=impl, filter_eps=None), 701, gout, keep_idx=keep)
    mask = torch.zeros(30)
    mask[keep] = 1
    rl, rdh, rdw = run_ref(h, w, t, 701, gout * mask)
    close(loss, run_ref(h, w, t, 701, gout)[0], 1e-6)  # forward covers every row
    dropped = torch.ones(30, dtype=torch.bool)
    dropped[keep] = False
    assert torch.all(dh[dropped] == 0) and torch.all(dh[3] == 0)
    close(dh, rdh, 1e-5)
    close(dw, rdw, 1e-5)


def test_split_pieces_merge_like_one_slice():
    """Two vocabulary slices' partials, merged by the caller, give the whole-vocabulary loss and gradients."""
    h, w, t, gout = inputs(33, 1000, 24, seed=7)
    lse_full, tl_full = shard_forward(h, w, t, 1000, backend="reference")
    parts = []
    for lo, hi in ((0, 400), (400, 1000)):
        tt = torch.where((t >= lo) & (t < hi), t - lo, -1)
        parts.append((tt, *shard_forward(h, w[lo:hi], tt, hi - lo, backend="reference")))
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    torch.testing.assert_close(lse, lse_full)
    torch.testing.assert_close(parts[0][2] + parts[1][2], tl_full)
    d_e = sum(shard_backward(h, w[lo:hi], p[0], lse, gout, gout, hi - lo, backend="reference")[0]
              for (lo, hi), p in zip(((0, 400), (400, 1000)), parts))  # fmt: skip
    _, rdh, _ = run_ref(h, w, t, 1000, gout)
    close(d_e, rdh, 1e-5)


@pytest.mark.parametrize(
    "field,value",
    [("impl", "cuda"), ("backend", "cuda"), ("filter_eps", 2.0), ("softcap", -1.0), ("z_loss", -1.0),
     ("cce_scratch_mb", 0)],
)  # fmt: skip
def test_config_errors_name_the_key(field, value):
    cfg = LossConfig(**{field: value})
    with pytest.raises(ConfigError, match=f"loss.{field}"):
        cfg.validate()


def test_vocab_order_ranks_columns_by_mean_logit():
    """The filtered backward's walk order: descending mean logit over the rows, only the real columns."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(50, 16, generator=g, dtype=torch.float64)
    w = torch.randn(300, 16, generator=g, dtype=torch.float64)
    order = vocab_order(h, w, 280)
    assert sorted(order.tolist()) == list(range(280))
    mean_logit = (h @ w[:280].T).mean(0)[order]
    assert torch.all(mean_logit[:-1] >= mean_logit[1:] - 1e-12)
    assert vocab_order(h[:0], w, 280) is None


def test_target_term_with_fp32_de_and_bf16_dw():
    """The row-owned one-hot pass: dE[r] −= gt·W[t_r], dW[t] −= gt·h[r], into an fp32 dE (grad_accum_fp32)
    next to a bf16 dW, with repeated targets and rows whose target lies in another shard."""
    from megasparse.loss.cce_launch import add_target_term

    g = torch.Generator().manual_seed(9)
    n, v, d = 37, 11, 8
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = torch.randn(v, d, generator=g).to(torch.bfloat16)
    t = torch.randint(-1, v, (n,), generator=g)
    gt = torch.rand(n, generator=g) + 0.5
    d_e = torch.zeros(n, d)
    d_c = torch.zeros(v, d, dtype=torch.bfloat16)
    add_target_term(h, w, t, gt, None, d_e, d_c)
    on = (t >= 0).double()
    ref_e = -(gt.double() * on)[:, None] * w.double()[t.clamp(min=0)]
    ref_c = torch.zeros(v, d, dtype=torch.float64)
    ref_c.index_add_(0, t.clamp(min=0), -(gt.double() * on)[:, None] * h.double())
    assert d_e.dtype == torch.float32 and d_c.dtype == torch.bfloat16
    torch.testing.assert_close(d_e.double(), ref_e, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(d_c.double(), ref_c, rtol=2e-2, atol=2e-2)


def _compact_grad(h, w, t, cfg, vocab_size, gout, idx):
    """The filtered backward's compact dE of the kept rows (a KeepHolder filled after the forward, as the trainer)."""
    from megasparse.ops.compact import CompactGrad, KeepHolder, KeepMeta

    holder = KeepHolder()
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = vocab_parallel_loss(hh, ww, t, cfg, vocab_start=0, vocab_size=vocab_size, keep_idx=holder)
    holder.meta = KeepMeta(idx, h.shape[0])
    grads = {}
    hh.register_hook(lambda g: grads.setdefault("h", g))
    loss.backward(gout)
    assert isinstance(grads["h"], CompactGrad)
    return loss.detach(), grads["h"].rows, ww.grad


@pytest.mark.parametrize("impl", ["cce", "materialized"])
@pytest.mark.parametrize("eps", [None, 2.0**-12])
def test_compact_kept_row_with_ignored_target_gets_zero_row(impl, eps):
    """Masked labels (e.g. prompt tokens) among the kept rows: zero dE rows, as the materialised loss gives."""
    h, w, t, gout = inputs(30, 701, 40, seed=11)
    t[[3, 17]] = -100
    idx = torch.tensor([1, 3, 4, 10, 17, 29])
    cfg = LossConfig(impl=impl, filter_eps=eps, backend="reference" if impl == "cce" else None)
    loss, rows, dw = _compact_grad(h, w, t, cfg, 701, gout, idx)
    assert rows.shape == (6, 40)
    assert torch.all(rows[1] == 0) and torch.all(rows[4] == 0) and rows[[0, 2, 3, 5]].abs().sum(1).gt(0).all()
    mask = torch.zeros(30)
    mask[idx] = 1
    _, rdh, rdw = run_ref(h, w, t, 701, gout * mask)
    tol = 1e-5 if eps is None else 5e-3
    close(rows, rdh[idx], tol)
    close(dw, rdw, tol)


def test_sp_rows_not_matching_targets_is_one_clear_line():
    h, w, t, _ = inputs(12, 97, 8, seed=12)
    with pytest.raises(ValueError, match=r"10 hidden rows × tp 1 .* 10 rows but 12 targets") as e:
        vocab_parallel_loss(h[:10], w, t, LossConfig(impl="cce"), vocab_start=0, vocab_size=97, sequence_parallel=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="11 hidden rows = 11 rows but 12 targets"):
        vocab_parallel_loss(h[:11], w, t, LossConfig(impl="materialized"), vocab_start=0, vocab_size=97)


def test_default_filter_threshold_follows_the_dtype():
    """filter_eps=auto is finfo(dtype).eps / 32: bf16 keeps its 2^-12, fp32 gets 2^-28 instead of bf16's."""
    from megasparse.loss import loss_options
    from megasparse.loss.config import filter_threshold

    assert LossConfig().filter_eps == "auto"
    assert filter_threshold("auto", torch.bfloat16) == 2.0**-12
    assert filter_threshold("auto", torch.float32) == 2.0**-28
    assert filter_threshold(None, torch.float32) is None and filter_threshold(1e-3, torch.float32) == 1e-3
    assert loss_options(LossConfig(), "cce", torch.float32, 10, 0, -100, False).filter_eps == 2.0**-28
    # flat fp32 logits (every p ~ 1/V, just under bf16's threshold): bf16's threshold drops nearly the whole
    # softmax gradient, fp32's keeps it
    h, w, t, gout = inputs(40, 5000, 32, seed=13)
    h *= 0.01
    _, exact, _ = run(h, w, t, LossConfig(impl="cce", filter_eps=None, backend="reference"), 5000, gout)
    _, auto, _ = run(h, w, t, LossConfig(impl="cce", backend="reference"), 5000, gout)
    _, bf16, _ = run(h, w, t, LossConfig(impl="cce", filter_eps=2.0**-12, backend="reference"), 5000, gout)
    close(auto, exact, 1e-6)
    err = float((bf16 - exact).norm() / exact.norm())
    assert err > 1e-2, err  # the one-hot part dominates dE here; the softmax part it drops is still 1.5%


def test_auto_impl_picks_by_materialised_logit_memory():
    """loss.impl=auto (the default): cce once [rows, V_local] fp32 logits exceed the budget, the materialised
    loss below it; the reason names both numbers."""
    from megasparse.config import load_config
    from megasparse.loss import resolve_impl

    cfg = LossConfig()
    assert cfg.impl == "auto" and cfg.materialize_budget_gib == 4.0
    impl, why = resolve_impl(cfg, 8192, 256000)  # 7.8 GiB of fp32 logits: Gemma-2's vocabulary
    assert impl == "cce" and "7.81 GiB" in why and "materialize_budget_gib=4.0" in why
    impl, why = resolve_impl(cfg, 8192, 64128)  # 1.96 GiB: Llama-3's vocabulary at TP=2
    assert impl == "materialized" and "1.96 GiB" in why
    assert resolve_impl(LossConfig(materialize_budget_gib=1.0), 8192, 64128)[0] == "cce"
    assert resolve_impl(LossConfig(impl="materialized"), 8192, 256000)[0] == "materialized"
    assert resolve_impl(LossConfig(impl="cce"), 8, 8)[0] == "cce"
    assert load_config(None, ["loss.materialize_budget_gib=0.5"]).loss.resolved_impl(8192, 64128) == "cce"
    with pytest.raises(ConfigError, match="loss.materialize_budget_gib"):
        LossConfig(materialize_budget_gib=0).validate()
    # the loss follows the choice: bitwise the materialised loss under the budget, CCE over it
    h, w, t, gout = inputs(33, 300, 16, seed=14)
    auto = run(h, w, t, LossConfig(filter_eps=None), 300, gout)
    mat = run(h, w, t, LossConfig(impl="materialized"), 300, gout)
    over = run(h, w, t, LossConfig(filter_eps=None, materialize_budget_gib=1e-9), 300, gout)
    cce = run(h, w, t, LossConfig(impl="cce", filter_eps=None), 300, gout)
    for a, b, c, d in zip(auto, mat, over, cce):
        assert torch.equal(a, b) and torch.equal(c, d)


def test_cce_scratch_reaches_the_gemm_backward(monkeypatch):
    """loss.cce_scratch_mb bounds the exact backward's chunk buffer: from a dotted override through LossOptions (the
    TP loss and the vocab-over-PP slices) to the GEMM backend's call, which the gradients do not depend on."""
    from megasparse.config import load_config
    from megasparse.loss import cce_launch
    from megasparse.loss.pipeline import _Slice
    from megasparse.loss.reference import torch_shard_backward, torch_shard_forward

    assert LossConfig().scratch_bytes is None
    cfg = load_config(None, ["loss.cce_scratch_mb=224"]).loss
    assert cfg.cce_scratch_mb == 224 and cfg.scratch_bytes == 224 * 2**20
    assert _Slice(cfg, 0, 300, 300, torch.float32, -100, 33).opt.scratch_bytes == 224 * 2**20
    seen = []

    def backward(*args, scratch=None, dc_out=None):  # the GEMM backend needs Triton: the reference computes
        seen.append(scratch)
        d_e, d_c = torch_shard_backward(*args[:8])
        if dc_out is None:
            return d_e, d_c
        dc_out.add_(d_c)
        return d_e, None

    monkeypatch.setattr(cce_launch, "gemm_shard_forward", torch_shard_forward)
    monkeypatch.setattr(cce_launch, "gemm_shard_backward", backward)
    h, w, t, gout = inputs(33, 300, 16, seed=15)
    ref = run(h, w, t, LossConfig(impl="cce", filter_eps=None, backend="reference"), 300, gout)
    for mb in (None, 7):
        got = run(h, w, t, LossConfig(impl="cce", filter_eps=None, backend="gemm", cce_scratch_mb=mb), 300, gout)
        assert seen[-1] == (None if mb is None else mb * 2**20)
        for a, b in zip(got, ref):
            close(a, b, 1e-6)
