"""The compact (filtered) step performs no host synchronisation beyond the dense step's (issue 11).

On a GPU every value the host reads from a device tensor is a synchronisation. On the CPU nothing syncs,
but the same reads happen: ``HostReads`` counts them (``.item()``, ``.tolist()``, ``nonzero``, ``equal``,
data-dependent boolean indexing), so these gloo tests pin the property the GPU test in
tests/test_gpu_sync.py measures with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import tiny
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default"}


class HostReads(TorchDispatchMode):
    """Counts the ops that read device values on the host (each one a stream synchronisation on CUDA)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _SYNCING or (name.startswith("aten.index.Tensor") and _bool_index(args)):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        reads = self.ops

        def tolist(t, *a, **k):
            reads.append("tolist")
            return self._tolist(t, *a, **k)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else []
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or [])


def reads_per_step(overrides: list[str]) -> dict:
    from megasparse.config import load_config
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, tiny(model__num_layers=2) + overrides))
    tr.train_step()  # warm-up: memoised metadata, lazy inits
    with HostReads() as reads:
        tr.train_step()
    return {"n": len(reads.ops), "ops": sorted(set(reads.ops))}


FILTER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]


@pytest.mark.parametrize("micro", [1, 2])
def test_filtered_step_reads_no_more_than_dense_one_rank(micro: int) -> None:
    mb = [f"train.micro_batch_size={micro}"]
    dense = run_distributed(reads_per_step, 1, mb)[0]
    filt = run_distributed(reads_per_step, 1, mb + FILTER)[0]
    assert filt["n"] == dense["n"], (dense, filt)


def test_unbalanced_selection_does_read_on_the_host() -> None:
    """The counter sees the per-sequence split of an unbalanced (microbatch) selection: the test can fail."""
    dense = run_distributed(reads_per_step, 1, [])[0]
    filt = run_distributed(reads_per_step, 1, FILTER + ["filter.granularity=microbatch"])[0]
    assert filt["n"] > dense["n"]


@pytest.mark.slow
def test_filtered_step_reads_no_more_than_dense_tp2_sp_pp2() -> None:
    lay = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    dense = run_distributed(reads_per_step, 4, lay)
    filt = run_distributed(reads_per_step, 4, lay + FILTER)
    for r, (d, f) in enumerate(zip(dense, filt)):
        assert f["n"] == d["n"], (r, d, f)
