"""GPU, 2+ ranks: a pipeline stage's captured graphs (train.cuda_graphs at pp > 1) train like the eager 1F1B step.

Each run trains a few steps on NCCL ranks: step 1 eager (the warm-up), step 2 captures every stage's slots and
replays them, later steps replay. The graph run's losses and gradient norms must match the eager run's, dense and
filtered (compact gradients crossing the stage boundary), at micro-batch 1 and 2, with 2:4 FFNs and with CCE. At
TP=2 × PP=2 + SP (4 GPUs) the compact gradient is split over SP ranks inside the captured backward; at PP=4 the two
middle stages receive and send in the same captured slots.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_MODES = {
    "dense": [],
    "collider": ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"],
    "collider+cce": ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss", "loss.impl=cce"],
    "2:4": [
        "sparsity.enabled=true",
        "sparsity.refresh_interval=3",
        "model.hidden_size=128",
        "model.ffn_hidden_size=256",
    ],
}


def _train(overrides: list[str], steps: int) -> dict:
    import torch.distributed as dist

    from megasparse.config import load_config
    from megasparse.train import Trainer

    base = tiny(model__num_layers=4, train__device="cuda", train__dtype="bf16", model__seq_length=256, **TRAINING)
    tr = Trainer(load_config(None, base + ["parallel.backend=nccl"] + overrides), init_groups=not dist.is_initialized())
    res = [tr.train_step() for _ in range(steps)]
    g = tr.graphs
    out = {
        "loss": [r.loss for r in res],
        "gnorm": [r.grad_norm for r in res],
        "captured": g.stage_graphs is not None or bool(g.recaptures),
        "blocker": g.blocker,
    }
    g.release()
    return out


def _all_cases(par: list[str], steps: int) -> dict:
    """Every (mode, micro-batch) case eager and captured, on one set of process groups (one spawn: NCCL set-up and
    kernel compilation are paid once)."""
    out = {}
    for mode, ov in _MODES.items():
        for micro in (1, 2):
            case = par + [f"train.micro_batch_size={micro}", "train.global_batch_size=8"] + ov
            out[f"{mode} mb{micro}"] = {
                "eager": _train(case + ["train.cuda_graphs=false"], steps),
                "graph": _train(case, steps),
            }
    return out


_LAYOUTS = {  # name: (GPUs, parallel overrides)
    "pp2": (2, ["parallel.pp=2"]),
    "tp2pp2sp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    # stages between the first and the last: input buffer and caught gradient in one slot, pp - rank slots each
    "pp4": (4, ["parallel.pp=4"]),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_captured_stages_equal_eager(layout: str) -> None:
    world, par = _LAYOUTS[layout]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    res = run_distributed(_all_cases, world, par, 5)
    bad = []
    for rank, cases in enumerate(res):
        for name, r in cases.items():
            e, g = r["eager"], r["graph"]
            if g["blocker"] is not None or not g["captured"]:
                bad.append(f"rank {rank} {name}: not captured ({g['blocker']})")
                continue
            if g["loss"][0] != pytest.approx(e["loss"][0], rel=1e-6) or e["loss"][0] == e["loss"][-1]:
                bad.append(f"rank {rank} {name}: first (eager) steps differ or loss flat: {e['loss']} {g['loss']}")
            for a, b in zip(g["loss"] + g["gnorm"], e["loss"] + e["gnorm"]):
                if a != pytest.approx(b, rel=2e-3):
                    bad.append(f"rank {rank} {name}: graph {g['loss']} {g['gnorm']} eager {e['loss']} {e['gnorm']}")
                    break
    assert not bad, "\n".join(bad)
