"""loss.vocab_over_pp: the output layer sliced over pipeline ranks trains exactly like one process,
and every pipeline rank does an equal share of the loss-layer FLOPs (fp32, gloo)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

BASE = tiny(
    **{**TRAINING, "optim__warmup_steps": 1},
    model__hidden_size=32,
    model__num_query_groups=4,
    model__ffn_hidden_size=64,
)
STEPS = 3
BLOCK = 64  # model.make_vocab_divisible_by: one vocabulary block
ROWS = 16 * 2  # seq_length · micro_batch_size
H = 32
VOCAB_PARAMS = ("embedding.weight", "output_weight")


def _run(overrides: list[str], steps: int) -> dict:
    from megasparse.config import load_config
    from megasparse.loss import pipeline as vocab_pp
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BASE + overrides))
    vocab_pp.reset_flops()
    tr.compute_gradients()
    flops = dict(vocab_pp.FLOPS)
    grads = full_state_dict(tr.model, grads=True)
    losses = [tr.train_step().loss for _ in range(steps)]
    val = tr.evaluate()
    return {
        "flops": flops,
        "grads": grads,
        "losses": losses,
        "val": val,
        "weights": full_state_dict(tr.model),
        "stage": tr.lay.pp_rank,
        "vocab_rows": {n: p.shape[0] for n, p in tr.model.named_parameters() if n in VOCAB_PARAMS},
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def single():
    return run_distributed(_run, 1, [], STEPS)[0]


def _check_equal(res: list[dict], single: dict) -> None:
    for r in res:
        for a, b in zip(r["losses"], single["losses"]):
            assert abs(a - b) / abs(b) < 1e-5, (r["losses"], single["losses"])
        assert abs(r["val"] - single["val"]) / single["val"] < 1e-5
    for key in ("grads", "weights"):
        got, want = res[0][key], single[key]
        assert set(got) == set(want)
        for k in want:
            assert got[k].shape == want[k].shape, k
            assert rel(got[k], want[k]) < 1e-5, (key, k, rel(got[k], want[k]))
    assert single["losses"][0] != single["losses"][-1]


@pytest.mark.slow
def test_pp4_vocab_over_pp_matches_single_and_balances_flops(single):
    res = run_distributed(_run, 4, ["parallel.pp=4", "loss.vocab_over_pp=true"], STEPS)
    _check_equal(res, single)
    num_mb = 4
    # forward + backward matmul FLOPs of the loss layer, per pipeline stage, for one step
    per_stage = [r["flops"]["forward"] + r["flops"]["backward"] for r in sorted(res, key=lambda r: r["stage"])]
    assert min(per_stage) > 0
    block = 6 * num_mb * ROWS * BLOCK * H
    assert max(per_stage) - min(per_stage) <= block, per_stage
    # the whole vocabulary is covered exactly once (250 real columns)
    assert sum(per_stage) == 6 * num_mb * ROWS * 250 * H
    # without vocab_over_pp the last stage alone would do sum(per_stage); now no stage does more than ~1/4 of it
    assert sum(per_stage) > 3.5 * max(per_stage)
    # memory: the output layer a quarter on every stage; the input embedding wherever the planner finds the least
    # activation memory (the later stages: 1F1B-like schedules front-load activations), all of it exactly once
    vpad = single["vocab_rows"]["output_weight"]
    emb = [r["vocab_rows"]["embedding.weight"] for r in sorted(res, key=lambda r: r["stage"])]
    assert all(r["vocab_rows"]["output_weight"] == vpad // 4 for r in res)
    assert sum(emb) == vpad and emb[-1] >= emb[0], emb


@pytest.mark.slow
def test_tp2_pp2_sp_vocab_over_pp_matches_single(single):
    # the whole input embedding on the last stage: the first stage holds none and still joins its collectives
    ov = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "loss.vocab_over_pp=true",
          "loss.embedding_pp_split=[0.0,1.0]"]  # fmt: skip
    res = run_distributed(_run, 4, ov, STEPS)
    _check_equal(res, single)
    vpad = single["vocab_rows"]["output_weight"]
    for r in res:  # per TP rank: stage 0 none, stage 1 half the vocabulary (TP=2)
        assert r["vocab_rows"]["embedding.weight"] == (0 if r["stage"] == 0 else vpad // 2)


MASK = ["filter.mode=loss_mask", "filter.scorer=loss", "filter.keep_ratio=0.5"]


@pytest.mark.slow
def test_pp2_vocab_over_pp_with_loss_mask_matches_single():
    """Selection on the last stage: its masked per-token gradient reaches the other stages' slices."""
    one = run_distributed(_run, 1, MASK, 2)[0]
    two = run_distributed(_run, 2, MASK + ["parallel.pp=2", "loss.vocab_over_pp=true"], 2)
    _check_equal(two, one)


@pytest.mark.slow
def test_pp2_output_only_over_pp_keeps_embedding_on_first_stage(single):
    res = run_distributed(_run, 2, ["parallel.pp=2", "loss.vocab_over_pp=true", "loss.embedding_over_pp=false"], STEPS)
    _check_equal(res, single)
    by_stage = {r["stage"]: r["vocab_rows"] for r in res}
    vpad = single["vocab_rows"]["output_weight"]
    assert by_stage[0] == {"embedding.weight": vpad, "output_weight": vpad // 2}
    assert by_stage[1] == {"output_weight": vpad // 2}


def test_bad_embedding_split_is_one_line():
    from megasparse.config import load_config
    from megasparse.configbase import ConfigError

    cfg = load_config(None, BASE + ["parallel.pp=2", "loss.vocab_over_pp=true", "loss.embedding_pp_split=[0.5]"])
    with pytest.raises(ConfigError, match="loss.embedding_pp_split") as e:
        cfg.validate(2)
    assert "\n" not in str(e.value)


def _ignored_rows_worker() -> dict:
    """PP=2: the last stage's loss and its peer's slice, with ignore_index rows, against one full-vocab slice."""
    from megasparse.loss import LossConfig
    from megasparse.loss import pipeline as vocab_pp
    from megasparse.parallel import state

    lay = state.init(tp=1, pp=2, backend="gloo")
    g = torch.Generator().manual_seed(3)
    n, v, h = 20, 2 * BLOCK, H
    hid = torch.randn(n, 1, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 3
    t = torch.randint(0, v, (n,), generator=g)
    t[[0, 7, 8, 19]] = -100
    gout = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    cfg = LossConfig(impl="cce", filter_eps=None, backend="reference")
    half = v // 2
    mine = slice(lay.pp_rank * half, (lay.pp_rank + 1) * half)
    wp = torch.nn.Parameter(w[mine].clone())
    out = {}
    vocab_pp.reset_flops()
    if lay.is_last_stage:
        hh = hid.clone().requires_grad_()
        loss = vocab_pp.vocab_pp_loss(hh, wp, t, cfg, vocab_start=mine.start, vocab_size=v)
        loss.backward(gout)
        out.update(loss=loss.detach(), d_h=hh.grad.reshape(n, h))
    else:
        peer = vocab_pp.VocabPPPeer(wp, cfg, vocab_start=mine.start, vocab_size=v, rows=n,
                                    compute_dtype=torch.float64)  # fmt: skip
        peer.step(t, train=True)
    out["d_w"] = wp.grad
    out["flops"] = dict(vocab_pp.FLOPS)
    state.destroy()
    # reference: one process, the whole vocabulary
    hr, wr = hid.reshape(n, h).clone().requires_grad_(), w.clone().requires_grad_()
    lg = hr @ wr.T
    valid = t != -100
    ref = torch.where(valid, torch.logsumexp(lg, 1) - lg.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ref.backward(gout)
    out.update(ref_loss=ref.detach(), ref_dh=hr.grad, ref_dw=wr.grad[mine], valid=valid)
    return out


def test_pp2_vocab_over_pp_drops_ignored_rows():
    # the slices' (lse, target logit) partials are merged in fp32, hence 1e-6 rather than fp64 agreement
    for r in run_distributed(_ignored_rows_worker, 2):
        assert rel(r["d_w"], r["ref_dw"]) < 1e-6
        rows = int(r["valid"].sum())  # ignored rows never reach the kernels
        assert r["flops"]["forward"] == 2 * rows * BLOCK * H and r["flops"]["backward"] == 4 * rows * BLOCK * H
        if "loss" in r:
            assert rel(r["loss"].double(), r["ref_loss"]) < 1e-6
            assert rel(r["d_h"], r["ref_dh"]) < 1e-6
            assert torch.all(r["d_h"][~r["valid"]] == 0) and torch.all(r["loss"][~r["valid"]] == 0)
