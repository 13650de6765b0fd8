"""The bf16 weight copies made once per optimizer step (decision 0009) train exactly like a cast at every use, also
under an optimizer that writes the fp32 masters without moving their version counters (fused AdamW)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

BF16 = tiny(**TRAINING, train__steps=6, train__dtype="bf16")
SPARSE = ["sparsity.enabled=true", "sparsity.refresh_interval=2", "sparsity.decay=1e-2"]


def _train(extra: list[str], copies: bool, fused: bool, steps: int = 4) -> dict:
    from megasparse.config import load_config
    from megasparse.model.builder import _decay_groups
    from megasparse.parallel.layers import _ParallelLinear
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BF16 + extra))
    linears = [m for m in tr.model.modules() if isinstance(m, _ParallelLinear)]
    if not copies:  # the per-use cast: what every layer did before
        tr.dp_opt.copies = None
        for m in linears:
            m.copy = None
    if fused:  # moves no version counter: only the refresh after the step keeps the copies current
        o = tr.cfg.optim
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in _decay_groups(tr.model, o)]
        tr.dp_opt.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    losses, stale = [], 0
    for _ in range(steps):
        losses.append(tr.train_step().loss)
        for m in linears:  # what the next forward will multiply with
            w = m.compute_weight()
            stale += int(w is not None and not torch.equal(w, m.weight.detach().to(torch.bfloat16)))
    kept = tr.dp_opt.copies.copies if tr.dp_opt.copies is not None else []
    return {"losses": losses, "stale": stale, "copies": len(kept), "linears": len(linears)}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("extra", [[], SPARSE], ids=["dense", "2:4"])
def test_copies_once_per_step_train_like_a_cast_per_use(extra, fused):
    res = run_distributed(_train, 1, extra, True, fused)[0]
    ref = run_distributed(_train, 1, extra, False, fused)[0]
    assert res["stale"] == 0
    # every linear keeps a copy; under 2:4 the FFN GEMMs keep their own (fc1, fc2 of each layer)
    assert res["copies"] == res["linears"] - (2 * 4 if extra else 0)
    assert res["losses"] == ref["losses"]  # the same bf16 operands: bitwise the same losses
    assert res["losses"][0] != res["losses"][-1]


def test_a_weight_written_in_place_is_copied_again():
    """A write outside the optimizer (a load, a test) moves the version: the next read copies before use."""
    from megasparse.parallel.layers import ComputeCopy

    w = torch.nn.Parameter(torch.randn(8, 4))
    c = ComputeCopy(w, torch.bfloat16)
    buf = c.get()
    with torch.no_grad():
        w.mul_(3.0)
    assert c.get() is buf  # the same buffer (a captured graph reads it) ...
    assert torch.equal(buf, (w.detach() * 1).to(torch.bfloat16))  # ... holding the new values
