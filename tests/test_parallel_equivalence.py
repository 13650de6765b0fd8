"""Every parallel layout trains like one process: same per-step losses and final weights (fp32, gloo)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

BASE = tiny(**TRAINING, train__steps=5)
STEPS = 5


def train_and_collect(overrides: list[str], steps: int) -> dict:
    from megasparse.config import load_config
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BASE + overrides))
    losses = [tr.train_step().loss for _ in range(steps)]
    return {"losses": losses, "weights": full_state_dict(tr.model)}


@pytest.fixture(scope="module")
def single():
    return run_distributed(train_and_collect, 1, [], STEPS)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2_pp2_uneven": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.layer_split=[1,3]"]),
    "dp2_tp2": (4, ["parallel.tp=2"]),
}


SPARSE = [
    "sparsity.enabled=true",
    "sparsity.refresh_interval=2",
    "sparsity.decay=1e-2",
    "sparsity.dense_finetune_fraction=0.2",
]


@pytest.mark.slow
def test_sparse24_tp2_matches_single_process():
    """2:4 FFNs: each TP shard keeps its own masks, and the result equals one process with whole matrices."""
    one = run_distributed(train_and_collect, 1, SPARSE, STEPS)[0]
    two = run_distributed(train_and_collect, 2, SPARSE + ["parallel.tp=2"], STEPS)[0]
    for a, b in zip(two["losses"], one["losses"]):
        assert abs(a - b) / abs(b) < 1e-5
    worst = max(rel(two["weights"][k], one["weights"][k]) for k in one["weights"])
    assert worst < 1e-5, worst
    # Sparse training is really different from dense training.
    dense = run_distributed(train_and_collect, 1, [], 2)[0]
    assert abs(dense["losses"][1] - one["losses"][1]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(single, name):
    world, ov = LAYOUTS[name]
    res = run_distributed(train_and_collect, world, ov, STEPS)
    for r in res:
        for a, b in zip(r["losses"], single["losses"]):
            assert abs(a - b) / abs(b) < 1e-5, (name, r["losses"], single["losses"])
    w = res[0]["weights"]
    assert set(w) == set(single["weights"])
    worst = max(rel(w[k], single["weights"][k]) for k in w)
    assert worst < 1e-5, (name, worst)
    # The run must actually have trained: weights moved away from their initial values.
    assert single["losses"][0] != single["losses"][-1]
