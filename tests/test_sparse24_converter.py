"""The 2:4 converter through the trainer: it converts exactly the FFN linears the model names for
``sparsity.layers``, its hooks refresh masks on schedule, and masks survive a checkpoint round trip."""

from __future__ import annotations

import torch
from distributed import run_distributed
from tiny import tiny

OV = tiny(model__num_layers=2, train__steps=6) + [
    "sparsity.enabled=true",
    "sparsity.layers=1",
    "sparsity.refresh_interval=2",
    "sparsity.dense_finetune_fraction=0.0",
    "optim.lr=5e-2",
]


def run(out: str) -> dict:
    from megasparse.config import load_config
    from megasparse.sparse24.gemm import Sparse24Gemm
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, OV + [f"logging.out_dir={out}"]))
    sparse = sorted(n for n, m in tr.model.named_modules() if isinstance(getattr(m, "gemm", None), Sparse24Gemm))
    results = [tr.train_step() for _ in range(4)]
    where = tr.save()
    masks = {k: v.clone() for k, v in tr.sparsity.manager.masks.items()}
    fresh = Trainer(load_config(None, OV + [f"logging.out_dir={out}"]), init_groups=False)
    before = {k: v.clone() for k, v in fresh.sparsity.manager.masks.items()}
    fresh.resume(str(where))
    return {
        "sparse": sparse,
        "extra": [r.extra for r in results],
        "masks": masks,
        "before": before,
        "resumed": fresh.sparsity.manager.masks,
        "step": fresh.step,
    }


def test_converter_hooks_and_checkpointed_masks(tmp_path):
    r = run_distributed(run, 1, str(tmp_path))[0]
    assert r["sparse"] == ["layers.1.mlp.fc1", "layers.1.mlp.fc2"]  # only the layer sparsity.layers names
    assert ["flip_rate" in e for e in r["extra"]] == [False, True, False, True]  # refresh every 2 steps
    assert all(e["sparse"] for e in r["extra"])
    assert r["step"] == 4 and set(r["resumed"]) == set(r["masks"])
    assert any(not torch.equal(r["before"][k], r["masks"][k]) for k in r["masks"])  # the round trip matters
    for k, m in r["masks"].items():
        assert torch.equal(r["resumed"][k], m)
        assert m.float().mean().item() == 0.5  # 2 of every 4 kept


def test_gemm_autotune_keeps_the_faster_backend() -> None:
    """Steps are timed with sparse, then masked dense GEMMs; the faster stays, and the choice is final."""
    from megasparse.sparse24 import converter

    class G:
        use_sparse, tunable = True, True

    for sparse_ms, dense_ms, want in ((10.0, 12.0, True), (12.0, 10.0, False)):
        gemms = [G(), G()]
        clock = [0.0]
        tune = converter.GemmAutotune(gemms, clock=lambda c=clock: c[0])
        for step in range(1, 12):
            # the interval that ends at this tick ran with the GEMMs the previous tick installed
            clock[0] += (sparse_ms if gemms[0].use_sparse else dense_ms) / 1e3
            tune.tick(step)
        assert tune.choice is want and all(g.use_sparse is want for g in gemms)
        assert len(tune.times[True]) == len(tune.times[False]) == 2
