"""GPU: a filtered forward+backward performs no more host synchronisations than the dense one (issue 11).

Counted with ``torch.cuda.set_sync_debug_mode("warn")`` over ``Trainer.compute_gradients`` (every micro-batch's
forward, selection, compact backward and the gradient reduction) after a warm-up step. The CPU tests in
tests/test_sync_free.py hold the same property on gloo at TP2×PP2+SP; this one needs one GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _syncs(overrides: list[str]) -> int:
    from megasparse.config import load_config
    from megasparse.train import Trainer

    base = tiny(model__num_layers=2, train__device="cuda", train__dtype="bf16", model__seq_length=256)
    tr = Trainer(load_config(None, base + ["parallel.backend=nccl"] + overrides), init_groups=False)
    tr.compute_gradients()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tr.compute_gradients()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    del tr
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def one_rank():
    import os

    from megasparse.parallel import state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    state.init(1, 1, False, "nccl")
    yield
    state.destroy()


@pytest.mark.parametrize("micro", [1, 2])
def test_filtered_fwd_bwd_syncs_no_more_than_dense(one_rank, micro: int) -> None:
    mb = [f"train.micro_batch_size={micro}"]
    dense = _syncs(mb)
    filt = _syncs(mb + ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"])
    assert filt <= dense, (dense, filt)
