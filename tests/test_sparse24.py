"""2:4 sparse training on CPU: mask search, MVUE, sparse linear (emulation path), recipe, decay-search helpers."""

from __future__ import annotations

import itertools

import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.ops.glu import gated_activation, gated_activation_reference
from megasparse.sparse24 import Sparse24Weight, SparsityManager, sparse24_backward, sparse24_linear, transposable_mask
from megasparse.sparse24.cli import choose_decay, flip_rate_at_end
from megasparse.sparse24.cli import main as sparsity_main
from megasparse.sparse24.config import SparsityConfig
from megasparse.sparse24.linear import pack_values
from megasparse.sparse24.masks import (
    PATTERNS,
    check_cusparselt_shape,
    is_transposable_24,
    kept_magnitude,
    transposable_mask_reference,
)
from megasparse.sparse24.mvue import mvue24_reference, mvue_probabilities, mvue_variance

# ------------------------------------------------------------------------------------------------ masks


def _brute_force_best(block: torch.Tensor) -> float:
    """Best kept |w| of a 4x4 block over every 0/1 matrix with two ones per row and column."""
    a = block.abs().double()
    best = -1.0
    pairs = list(itertools.combinations(range(4), 2))
    for rows in itertools.product(pairs, repeat=4):
        cols = [0] * 4
        for a_, b_ in rows:
            cols[a_] += 1
            cols[b_] += 1
        if cols == [2, 2, 2, 2]:
            best = max(best, sum(float(a[r, c]) for r, pr in enumerate(rows) for c in pr))
    return best


def test_pattern_table_is_the_90_transposable_patterns():
    p = PATTERNS.reshape(-1, 4, 4)
    assert p.shape[0] == 90
    assert len({tuple(x.flatten().tolist()) for x in p}) == 90
    assert bool((p.sum(1) == 2).all() and (p.sum(2) == 2).all())


@pytest.mark.parametrize("shape", [(4, 4), (8, 12), (20, 36)])
def test_mask_is_optimal_against_brute_force(shape):
    w = torch.randn(*shape)
    if shape == (8, 12):
        w[:4, :4] = 1.0  # a block of exact ties
    m = transposable_mask_reference(w)
    assert is_transposable_24(m)
    kept = kept_magnitude(w, m)
    for bi in range(shape[0] // 4):
        for bj in range(shape[1] // 4):
            best = _brute_force_best(w[4 * bi : 4 * bi + 4, 4 * bj : 4 * bj + 4])
            assert kept[bi, bj].item() == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_mask_every_block_row_and_column_has_two():
    m = transposable_mask(torch.randn(64, 96, dtype=torch.bfloat16))
    b = m.reshape(16, 4, 24, 4).int()
    assert bool((b.sum(3) == 2).all()) and bool((b.sum(1) == 2).all())
    assert m.float().mean().item() == 0.5


def test_mask_shape_errors_name_shape_and_rule():
    with pytest.raises(ConfigError, match=r"\[6, 8\].*multiples of 4"):
        transposable_mask(torch.randn(6, 8))
    with pytest.raises(ConfigError, match=r"fc1.*\[96, 200\].*multiples of 64"):
        check_cusparselt_shape((96, 200), "fc1")
    check_cusparselt_shape((128, 256), "fc1")


def test_shard_masks_equal_full_mask_slices():
    w = torch.randn(32, 48)
    full = transposable_mask(w)
    for rows in (slice(0, 16), slice(16, 32)):
        assert torch.equal(transposable_mask(w[rows]), full[rows])
    for cols in (slice(0, 24), slice(24, 48)):
        assert torch.equal(transposable_mask(w[:, cols].contiguous()), full[:, cols])


def test_pack_values_reference_order():
    w = torch.randn(8, 16)
    m = transposable_mask(w)
    p = pack_values(w, m)
    assert p.shape == (8, 8)
    for r in range(8):
        assert torch.equal(p[r], w[r][m[r]])
    pt = pack_values(w.t(), m.t())
    assert torch.equal(pt[3], w[:, 3][m[:, 3]])


# ------------------------------------------------------------------------------------------------ MVUE


def test_mvue_probabilities_are_capped_water_filling():
    a = torch.tensor([[10.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    q = mvue_probabilities(a)
    torch.testing.assert_close(q[0], torch.tensor([1.0, 0.5, 0.5, 0.0]))
    torch.testing.assert_close(q[1], torch.full((4,), 0.5))
    torch.testing.assert_close(q[2], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(q[3], torch.tensor([1.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("dim", [0, 1])
def test_mvue_structure_unbiased_and_minimum_variance(dim):
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64) * torch.rand(8, 6, dtype=torch.float64) * 3
    x[0:4, 0] = torch.tensor([5.0, 0.1, 0.0, 0.2], dtype=torch.float64)  # a capped group
    if dim == 1:
        x = x.t().contiguous()
    draws = 4000
    gen = torch.Generator().manual_seed(1)
    outs = torch.stack([mvue24_reference(x, dim, generator=gen) for _ in range(draws)])
    groups = (outs != 0).reshape(draws, *([2, 4, 6] if dim == 0 else [6, 2, 4])).sum(2 if dim == 0 else 3)
    assert bool((groups <= 2).all())
    mean, var = outs.mean(0), outs.var(0)
    xg = x if dim == 0 else x.t()
    analytic = mvue_variance(xg.reshape(2, 4, 6).permute(0, 2, 1)).permute(0, 2, 1).reshape(8, 6)
    analytic = analytic if dim == 0 else analytic.t()
    stderr = (analytic / draws).sqrt()
    assert bool(((mean - x).abs() <= 5 * stderr + 1e-12).all()), "MVUE is biased"
    torch.testing.assert_close(var.sum(), analytic.sum(), rtol=0.08, atol=1e-9)
    naive = (x * x).sum()  # keep a uniform random pair, scale by 2: variance a² per entry
    assert analytic.sum() <= naive + 1e-12


def test_mvue_deterministic_given_generator():
    x = torch.randn(16, 8)
    a = mvue24_reference(x, 0, generator=torch.Generator().manual_seed(7))
    b = mvue24_reference(x, 0, generator=torch.Generator().manual_seed(7))
    c = mvue24_reference(x, 0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------------------------ sparse linear


@pytest.mark.parametrize("mvue", [False, True])
def test_sparse_linear_matches_masked_dense_fp64(mvue):
    torch.manual_seed(3)
    n, din, dout = 24, 16, 12
    w = torch.nn.Parameter(torch.randn(dout, din, dtype=torch.float64))
    x = torch.randn(n, din, dtype=torch.float64, requires_grad=True)
    st = Sparse24Weight(w, transposable_mask(w.detach()), backend="emulate", name="fc")
    y = sparse24_linear(x, w, st, mvue=mvue)
    gy = torch.randn(n, dout, dtype=torch.float64)
    y.backward(gy)
    ws = w.detach() * st.mask
    torch.testing.assert_close(y.detach(), x.detach() @ ws.t(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, gy @ ws, rtol=1e-12, atol=1e-12)
    if mvue:
        seed = st._calls  # the seed the backward used is the state's last one
        st._calls = seed - 1
        g = torch.Generator().manual_seed(st.next_seed())
        pruned = mvue24_reference(gy, 0, generator=g)
        assert (pruned != 0).sum() <= gy.numel() // 2
        ref_gw = pruned.t() @ x.detach()
    else:
        ref_gw = gy.t() @ x.detach()
    # straight-through: the dense weight gets the full gradient, masked entries included
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-12, atol=1e-12)
    assert (w.grad[~st.mask] != 0).any()


def test_sparse_linear_refreshes_after_weight_update_once():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    st = Sparse24Weight(w, transposable_mask(w.detach()), backend="emulate")
    x = torch.randn(4, 8, dtype=torch.float64)
    sparse24_linear(x, w, st)
    sparse24_linear(x, w, st)
    v = st.version
    with torch.no_grad():
        w.add_(1.0)
    y = sparse24_linear(x, w, st)
    assert st.version == v + 1
    torch.testing.assert_close(y, x @ (w.detach() * st.mask).t())


def test_refresh_builds_only_the_operands_the_gemms_read(monkeypatch):
    """A refresh skips W ⊙ M once the GEMMs are known to read only packed operands, and the packing once they
    read only W ⊙ M; an operand a GEMM asks for after a skipped refresh is built then, so results never go stale;
    switching GEMMs (the autotune) forgets what was learned."""
    w = torch.randn(8, 16, dtype=torch.float64)
    st = Sparse24Weight(w, transposable_mask(w), backend="emulate")
    packs = []
    st.can_sparse = True  # packing itself needs cuSPARSELt; record the calls instead
    monkeypatch.setattr(st, "_refresh_sparse", lambda wt: packs.append(wt.sum().item()))
    st.refresh(w)
    assert len(packs) == 1  # nothing known yet: both built (W ⊙ M lazily, on first use)
    torch.testing.assert_close(st.dense_weight(), w * st.mask)
    w2 = w + 1
    st.refresh(w2)
    assert len(packs) == 1  # only W ⊙ M was read: no packing
    torch.testing.assert_close(st.dense_weight(), w2 * st.mask)
    st.sparse_operands()  # a GEMM now needs the packed operands: built for this version
    assert len(packs) == 2
    st.sparse_operands()
    assert len(packs) == 2
    st.use_sparse = False
    st.use_sparse = True  # another plan: unknown again, both rebuilt eagerly
    st.refresh(w2 + 1)
    assert len(packs) == 3
    masked = st._masked
    st.sparse_operands()
    st.refresh(w2 + 2)  # only packed read since: W ⊙ M is stale ...
    assert len(packs) == 4 and st._masked_at != st.version
    torch.testing.assert_close(st.dense_weight(), (w2 + 2) * st.mask)  # ... until asked for, in place
    assert st.dense_weight() is masked


def test_backward_on_kept_rows_only():
    """The token-filter wrapper calls sparse24_backward with the kept rows of ∇Y and of X."""
    w = torch.nn.Parameter(torch.randn(8, 12, dtype=torch.float64))
    st = Sparse24Weight(w, transposable_mask(w.detach()), backend="emulate")
    x = torch.randn(10, 12, dtype=torch.float64)
    keep = torch.tensor([0, 3, 4, 9])
    gy_kept = torch.randn(4, 8, dtype=torch.float64)
    gx, gw = sparse24_backward(gy_kept, x[keep], w, st, mvue=False)
    ws = w.detach() * st.mask
    gy_full = torch.zeros(10, 8, dtype=torch.float64).index_copy(0, keep, gy_kept)
    torch.testing.assert_close(gx, (gy_full @ ws)[keep])
    torch.testing.assert_close(gw, gy_full.t() @ x)


def test_gated_activation_reference_grads():
    z = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    for kind in ("swiglu", "geglu"):
        assert torch.autograd.gradcheck(lambda t, k=kind: gated_activation(t, k), (z,))
    g, up = z.detach().chunk(2, 1)
    torch.testing.assert_close(gated_activation_reference(z.detach(), "swiglu"), g * torch.sigmoid(g) * up)


# ------------------------------------------------------------------------------------------------ recipe


def _params(*shapes):
    torch.manual_seed(0)
    return {f"l{i}": torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for i, s in enumerate(shapes)}


def test_masked_decay_adds_lambda_times_pruned_weights():
    ps = _params((8, 16), (16, 8))
    cfg = SparsityConfig(enabled=True, decay=0.5, backend="emulate")
    mgr = SparsityManager(ps, cfg, total_steps=60)
    for p in ps.values():
        p.grad = torch.ones_like(p)
    mgr.apply_masked_decay()
    for name, p in ps.items():
        m = mgr.masks[name]
        torch.testing.assert_close(p.grad[m], torch.ones_like(p.grad[m]))
        torch.testing.assert_close(p.grad[~m], 1 + 0.5 * p.detach()[~m])


def test_refresh_cadence_flip_rate_and_dense_switch():
    ps = _params((8, 16))
    cfg = SparsityConfig(enabled=True, refresh_interval=3, dense_finetune_fraction=0.25, backend="emulate")
    mgr = SparsityManager(ps, cfg, total_steps=12)
    assert mgr.switch_step == 9
    w = ps["l0"]
    old = mgr.masks["l0"].clone()
    st = mgr.state("l0")
    seen = {}
    for step in range(1, 13):
        with torch.no_grad():
            w.mul_(torch.where(torch.rand_like(w) < 0.3, -0.1, 1.0) * 10 ** torch.rand_like(w))
        seen[step] = mgr.after_step(step)
        if step in (3, 6):
            new = transposable_mask(w.detach())
            assert torch.equal(mgr.masks["l0"], new)
            expect = (new != old).double().mean().item()
            assert seen[step]["l0"] == pytest.approx(expect) and seen[step]["all"] == pytest.approx(expect)
            assert 0 < expect <= 1
            assert st.mask is not old and torch.equal(st.mask, new)
            old = new.clone()
        elif step < 9:
            assert seen[step] == {}
            assert torch.equal(mgr.masks["l0"], old)
        if step >= 9:
            assert mgr.state("l0") is None and seen[step] == {}
    grads_before = torch.zeros_like(w)
    w.grad = grads_before.clone()
    mgr.apply_masked_decay()
    assert torch.equal(w.grad, grads_before), "no masked decay during dense fine-tuning"


def test_monitor_only_trains_dense_but_reports_flip_rates():
    ps = _params((8, 8))
    mgr = SparsityManager(ps, SparsityConfig(enabled=True, monitor_only=True, refresh_interval=1), total_steps=10)
    assert mgr.state("l0") is None
    with torch.no_grad():
        ps["l0"].mul_(-1).add_(torch.randn(8, 8, dtype=torch.float64))
    assert "l0" in mgr.after_step(1)


def test_state_dict_round_trip():
    ps = _params((8, 16), (16, 8))
    cfg = SparsityConfig(enabled=True, refresh_interval=2, backend="emulate")
    mgr = SparsityManager(ps, cfg, total_steps=100)
    with torch.no_grad():
        for p in ps.values():
            p.add_(torch.randn_like(p))
    mgr.after_step(2)
    sd = mgr.state_dict()
    ps2 = {k: torch.nn.Parameter(v.detach().clone()) for k, v in ps.items()}
    with torch.no_grad():
        for p in ps2.values():
            p.add_(5 * torch.randn_like(p))  # masks must come from the checkpoint, not the weights
    mgr2 = SparsityManager(ps2, cfg, total_steps=100)
    mgr2.load_state_dict(sd)
    assert mgr2.step == 2
    for k in ps:
        assert torch.equal(mgr2.masks[k], mgr.masks[k]) and torch.equal(mgr2.state(k).mask, mgr.masks[k])
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(
        sparse24_linear(x, ps2["l0"], mgr2.state("l0")), x @ (ps2["l0"].detach() * mgr.masks["l0"]).t()
    )


def test_manager_rejects_bad_shard_shape():
    with pytest.raises(ConfigError, match="decoder.fc2"):
        SparsityManager({"decoder.fc2": torch.nn.Parameter(torch.randn(8, 10))}, SparsityConfig(), 10)


# ------------------------------------------------------------------------------------------------ decay search


def test_decay_search_helpers():
    rates = [{}, {"a": 0.2, "all": 0.1}, {}, {"a": 0.4, "all": 0.3}]
    assert flip_rate_at_end(rates, window=1) == pytest.approx(0.3)
    assert flip_rate_at_end(rates, window=5) == pytest.approx(0.2)
    assert choose_decay({1e-6: 1.3, 6e-6: 0.9, 6e-5: 0.7, 2e-4: 0.3}) == 6e-6
    assert choose_decay({1e-6: 1.3}) is None


def test_decay_search_cli_reports_bad_config(tmp_path, capsys):
    assert sparsity_main(["decay-search", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_decay_search_orchestration(monkeypatch, tmp_path, capsys):
    """The CLI runs one dense monitor-only run and one sparse run per λ, and recommends the smallest feasible λ.

    The trainer is replaced by a flip-rate model (sparse rate falls with λ) because megasparse.train does not
    expose run_training yet; the configs it receives are the real parsed ones."""
    import megasparse.train as train_mod

    seen = []

    def fake_run_training(cfg):
        seen.append((cfg.sparsity.monitor_only, cfg.sparsity.decay, cfg.train.steps, cfg.sparsity.enabled))
        rate = 0.1 if cfg.sparsity.monitor_only else 0.1 * 1.2 / (1 + cfg.sparsity.decay * 1e5)
        return {"flip_rates": [{}, {"all": rate}], "losses": [1.0, 0.9]}

    monkeypatch.setattr(train_mod, "run_training", fake_run_training, raising=False)
    out = tmp_path / "d.json"
    rc = sparsity_main(["decay-search", "configs/cpu_toy.yaml", "--decays", "1e-7,3e-6,1e-5", "--steps", "4"])
    assert rc == 0
    rc = sparsity_main(["decay-search", "configs/cpu_toy.yaml", "--decays", "1e-6", "--json", str(out)])
    assert rc == 1 and out.exists()  # μ = 1.09: not feasible
    assert seen[0][0] is True and all(s[3] for s in seen) and seen[1][2] == 4
    assert "recommended sparsity.decay=3e-06" in capsys.readouterr().out


def test_gemm_compute_copy_is_the_masked_weight_through_refreshes_and_the_dense_switch():
    """With fp32 masters and bf16 compute, the 2:4 GEMMs' copy is W ⊙ M itself (no second W ⊙ M buffer); a master
    written without a version bump (the fused step) is copied again after the step, a new mask re-multiplies it
    from the master, and the dense phase gets the plain copy."""
    from megasparse.sparse24.gemm import Sparse24Gemm

    w = torch.nn.Parameter(torch.randn(8, 16))
    mgr = SparsityManager({"fc": w}, SparsityConfig(enabled=True, refresh_interval=1000), total_steps=100)
    gemm = Sparse24Gemm(mgr, "fc", w, torch.bfloat16, mvue=False)
    x = torch.randn(4, 16, dtype=torch.bfloat16)

    def expect(mask):
        return x @ (w.detach() * mask).to(torch.bfloat16).t()

    assert torch.equal(gemm.fwd(x, None), expect(mgr.masks["fc"]))
    st = gemm._state
    assert st.source_masked and st.dense_weight().data_ptr() == gemm._w.data_ptr()  # no separate W ⊙ M
    assert torch.equal(gemm._w, (w.detach() * mgr.masks["fc"]).to(torch.bfloat16))
    w.data.add_(0.5)  # an optimizer writing through .data: no version bump
    mgr.after_step(1)
    assert torch.equal(gemm.fwd(x, None), expect(mgr.masks["fc"]))
    new = ~mgr.masks["fc"]  # any other mask object: the copy is re-multiplied from the master, not from itself
    mgr.masks["fc"] = new
    assert torch.equal(gemm.fwd(x, None), expect(new))
    mgr._go_dense()
    assert torch.equal(gemm.operand(), w.detach().to(torch.bfloat16))  # dense phase: every weight back


def test_replay_key_is_stable_while_the_operands_stay_in_place():
    """The captured step is re-captured only when the GEMMs' buffers change: refreshing values in place (every
    optimizer step) must leave the key as it was, a new mask must change it."""
    from megasparse.sparse24.gemm import Sparse24Gemm

    w = torch.nn.Parameter(torch.randn(8, 16))
    mgr = SparsityManager({"fc": w}, SparsityConfig(enabled=True, refresh_interval=1000), total_steps=100)
    gemm = Sparse24Gemm(mgr, "fc", w, torch.bfloat16, mvue=False)
    gemm.fwd(torch.randn(4, 16, dtype=torch.bfloat16), None)
    key = gemm.prepare_replay()
    for step in (1, 2):
        w.data.add_(0.1)
        mgr.after_step(step)
        assert gemm.prepare_replay() == key
    mgr.masks["fc"] = ~mgr.masks["fc"]
    assert gemm.prepare_replay() != key


def test_replay_key_of_a_dense_phase_layer_names_its_refreshed_copy():
    """Dense fine-tuning (and monitor-only) layers are not in ComputeCopies: preparing a replay must refresh their
    compute copy, since the captured graph reads it and runs no Python."""
    from megasparse.sparse24.gemm import Sparse24Gemm

    w = torch.nn.Parameter(torch.randn(8, 16))
    mgr = SparsityManager({"fc": w}, SparsityConfig(enabled=True, refresh_interval=1000), total_steps=100)
    gemm = Sparse24Gemm(mgr, "fc", w, torch.bfloat16, mvue=False)
    gemm.fwd(torch.randn(4, 16, dtype=torch.bfloat16), None)
    mgr._go_dense()
    key = gemm.prepare_replay()
    w.data.add_(0.5)  # the optimizer's step, no version bump
    mgr.updates += 1
    assert gemm.prepare_replay() == key  # refreshed in place: same buffer, no re-capture
    assert torch.equal(gemm._w, w.detach().to(torch.bfloat16))
