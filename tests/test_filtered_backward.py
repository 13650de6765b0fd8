"""Collider exactness: the dimension-reduced backward equals an explicit reference of the same semantics.

The reference (tests/reference_model.py) is plain PyTorch autograd with filtered tokens made stop-gradient in
every layer; megasparse runs its compact-gradient backward under TP, SP, PP and DP (gloo, fp32).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from reference_model import per_token_loss
from tiny import tiny

# microbatch: the exact Rho-1 choice these references select with (the default, balanced, has its own cases)
BASE = tiny(model__num_layers=3, filter__scorer="random", filter__granularity="microbatch")


def grads_of(overrides: list[str]) -> dict:
    from megasparse.config import load_config
    from megasparse.ops.compact import densify_count
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    cfg = load_config(None, BASE + overrides)
    tr = Trainer(cfg)
    weights = full_state_dict(tr.model)
    before = densify_count()
    tr.compute_gradients()
    return {
        "grads": full_state_dict(tr.model, grads=True),
        "weights": weights,
        "densified": densify_count() - before,
        "kept_rows": tr.filter.kept_rows if tr.filter is not None else 0,
        "num_mb": tr.num_mb * tr.dp,
        "mb": cfg.train.micro_batch_size,
    }


def reference_grads(res: dict, mode: str, keep_ratio: float, granularity: str = "microbatch", sp: int = 1) -> dict:
    """Gradients of the explicit reference on the same global batch and the same (random) selection."""
    from megasparse.config import load_config
    from megasparse.data.dataset import SyntheticData
    from megasparse.filtering.selection import select_tokens

    cfg = load_config(None, BASE)
    params = {k: v.clone().requires_grad_() for k, v in res["weights"].items()}
    data = SyntheticData(250, cfg.model.seq_length, cfg.data.seed)
    mb = res.get("mb", cfg.train.micro_batch_size)
    total = 0.0
    for j in range(res["num_mb"]):
        tok = torch.stack([data.global_sample(j * mb + i) for i in range(mb)])
        ids, tgt = tok[:, :-1].t(), tok[:, 1:].t()
        keep = None
        if mode != "off":
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + j)
            scores = torch.rand(ids.shape, generator=gen)
            keep = select_tokens(scores, keep_ratio, granularity, sp_size=sp).mask
        loss = per_token_loss(params, cfg.model, 250, ids, tgt, keep if mode == "collider" else None)
        if keep is not None:
            loss = loss * keep
        total = total + loss.sum()
    norm = res["kept_rows"] * res["num_mb"] if mode != "off" else res["num_mb"] * mb * cfg.model.seq_length
    (total / norm).backward()
    return {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}


def assert_close(got: dict, ref: dict, tol: float = 1e-5):
    assert set(got) == set(ref)
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-20)).item()
        assert err < tol, (k, err)


def test_cce_loss_collider_matches_reference():
    res = run_distributed(
        grads_of, 1, ["filter.mode=collider", "filter.keep_ratio=0.5", "loss.impl=cce", "loss.filter_eps=null"]
    )[0]
    assert_close(res["grads"], reference_grads(res, "collider", 0.5))
    assert res["densified"] == 0


def test_sequence_granularity_batched_attention_matches_reference():
    """Equal kept counts per sequence take the batched attention backward (one kernel for the micro-batch)."""
    ov = ["filter.mode=collider", "filter.keep_ratio=0.5", "filter.granularity=sequence"]
    res = run_distributed(grads_of, 1, ov)[0]
    assert_close(res["grads"], reference_grads(res, "collider", 0.5, "sequence"))
    assert res["densified"] == 0


def test_balanced_granularity_two_sequences_matches_reference():
    """The default granularity at micro-batch 2: per-sequence metadata from one device sort (no host sync)."""
    ov = ["filter.mode=collider", "filter.keep_ratio=0.5", "filter.granularity=balanced"]
    res = run_distributed(grads_of, 1, ov)[0]
    assert_close(res["grads"], reference_grads(res, "collider", 0.5, "balanced"))
    assert res["densified"] == 0


def test_one_sequence_per_micro_batch_matches_reference():
    """Micro-batch 1 takes the sync-free single-sequence path of the compact attention backward."""
    ov = ["filter.mode=collider", "filter.keep_ratio=0.5", "train.micro_batch_size=1"]
    res = run_distributed(grads_of, 1, ov)[0]
    assert_close(res["grads"], reference_grads(res, "collider", 0.5))


def test_keep_ratio_one_is_dense():
    dense = run_distributed(grads_of, 1, [])[0]
    full = run_distributed(grads_of, 1, ["filter.mode=collider", "filter.keep_ratio=1.0"])[0]
    assert_close(full["grads"], dense["grads"])


def test_loss_mask_gives_masked_loss_gradients():
    res = run_distributed(grads_of, 1, ["filter.mode=loss_mask", "filter.keep_ratio=0.5"])[0]
    assert_close(res["grads"], reference_grads(res, "loss_mask", 0.5))


def test_single_process_collider_matches_reference_and_differs_from_masked():
    res = run_distributed(grads_of, 1, ["filter.mode=collider", "filter.keep_ratio=0.5"])[0]
    ref = reference_grads(res, "collider", 0.5)
    assert_close(res["grads"], ref)
    masked = reference_grads(res, "loss_mask", 0.5)
    # Collider semantics really are different from the masked-loss gradient (the test could fail).
    k = "layers.0.attn.qkv.weight"
    assert ((masked[k] - ref[k]).norm() / ref[k].norm()).item() > 1e-3
    # The backward never built a dense gradient on the way.
    assert res["densified"] == 0


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"], "microbatch"),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "microbatch"),
    "tp2_sp_shard": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "filter.granularity=shard"], "shard"),
    "pp2": (2, ["parallel.pp=2"], "microbatch"),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], "microbatch"),
    "dp2": (2, [], "microbatch"),
    # vocabulary layers over the pipeline (lock-step schedule, kept-row slot, compact P2P in the exchange)
    "pp2_vocab_pp": (2, ["parallel.pp=2", "loss.vocab_over_pp=true"], "microbatch"),
    "tp2_sp_pp2_vocab_pp": (
        4,
        ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "loss.vocab_over_pp=true"],
        "microbatch",
    ),
    # balanced (the default): static counts per (SP shard, sequence), no host sync, no padding
    "tp2_sp_pp2_balanced": (
        4,
        ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "filter.granularity=balanced"],
        "balanced",
    ),
    # micro-batch 1 through TP, SP and the pipeline: the compact attention backward's in-order path
    "tp2_sp_pp2_mb1": (
        4,
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.sequence_parallel=true",
            "train.micro_batch_size=1",
            "filter.granularity=balanced",
        ],
        "balanced",
    ),
    "tp2_sp_cce": (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "loss.impl=cce", "loss.filter_eps=null"],
        "microbatch",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collider_layout_matches_reference(name):
    world, ov, gran = LAYOUTS[name]
    res = run_distributed(grads_of, world, ["filter.mode=collider", "filter.keep_ratio=0.6"] + ov)
    sp = 2 if "parallel.sequence_parallel=true" in ov else 1
    ref = reference_grads(res[0], "collider", 0.6, gran, sp)
    assert_close(res[0]["grads"], ref)
    assert all(r["densified"] == 0 for r in res)


def run_steps(overrides: list[str], steps: int) -> list[float]:
    from megasparse.config import load_config
    from megasparse.ops.compact import densify_count
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BASE + overrides))
    losses = [tr.train_step().loss for _ in range(steps)]
    assert densify_count() == 0
    return losses


@pytest.mark.slow
def test_all_three_accelerations_compose_under_tp_sp():
    """Collider filtering + CCE loss + 2:4 sparse FFNs together at TP=2 with SP: trains, never densifies."""
    ov = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "filter.mode=collider",
        "filter.keep_ratio=0.6",
        "loss.impl=cce",
        "sparsity.enabled=true",
        "sparsity.refresh_interval=2",
        "train.steps=4",
    ]
    res = run_distributed(run_steps, 2, ov, 4)
    assert res[0] == res[1]
    assert all(torch.isfinite(torch.tensor(res[0])))


def one_line_api(keep_ratio: float) -> dict:
    """A custom loop with ``backward_filter`` gives the trainer's Collider gradients."""
    from megasparse.config import load_config
    from megasparse.data.dataset import SyntheticData
    from megasparse.filtering.api import KeepHolder, backward_filter
    from megasparse.filtering.selection import select_tokens
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    cfg = load_config(None, BASE + ["train.global_batch_size=2"])
    tr = Trainer(cfg)
    weights = full_state_dict(tr.model)
    tok = torch.stack([SyntheticData(250, 16, cfg.data.seed).global_sample(i) for i in range(2)])
    ids, tgt = tok[:, :-1].t().contiguous(), tok[:, 1:].t()
    holder = KeepHolder()
    per_token = tr.model(ids, tgt.reshape(-1), holder)
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003)
    keep = select_tokens(torch.rand(ids.shape, generator=gen), keep_ratio, "microbatch").mask
    backward_filter(per_token, keep, holder)
    return {
        "grads": full_state_dict(tr.model, grads=True),
        "weights": weights,
        "kept_rows": int(keep.sum()),
        "num_mb": 1,
    }


def test_backward_filter_one_line_api():
    res = run_distributed(one_line_api, 1, 0.5)[0]
    assert_close(res["grads"], reference_grads(res, "collider", 0.5))
