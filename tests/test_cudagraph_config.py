"""Which runs capture CUDA graphs (``cudagraph.capture_blocker``), decided from the config alone: no device needed.

Pipeline stages under plain 1F1B capture (one graph pair per in-flight slot); the interleaved schedule, lock-step
vocabulary over the pipeline and selections whose per-SP-rank row count depends on the data stay eager and say why.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny

from megasparse.config import load_config
from megasparse.cudagraph import capture_blocker

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated
_COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]


def _blocker(*overrides: str, pp: int = 2) -> str | None:
    cfg = load_config(None, tiny(model__num_layers=4) + [f"parallel.pp={pp}", *overrides])
    return capture_blocker(cfg, pp, CUDA)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        _COLLIDER,
        _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true"],
        _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=1"],
        _COLLIDER + ["filter.granularity=microbatch"],  # no SP: a stage's row count is the kept total
        ["loss.impl=cce", "sparsity.enabled=true"],
    ],
)
def test_plain_1f1b_stages_capture(overrides: list[str]) -> None:
    assert _blocker(*overrides) is None


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["parallel.virtual_stages=2", "train.global_batch_size=8"], "parallel.virtual_stages"),
        (["loss.vocab_over_pp=true"], "vocab_over_pp"),
        (
            _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true", "filter.granularity=sequence"],
            "filter.granularity=sequence",
        ),
        (_COLLIDER[:-1] + ["filter.scorer=random"], "filter.scorer=random"),
        (["train.cuda_graphs=false"], "train.cuda_graphs=false"),
    ],
)
def test_stages_that_stay_eager_say_why(overrides: list[str], says: str) -> None:
    why = _blocker(*overrides)
    assert why is not None and says in why, why


def test_cpu_runs_stay_eager() -> None:
    cfg = load_config(None, tiny(model__num_layers=4) + ["parallel.pp=2"])
    assert capture_blocker(cfg, 2, torch.device("cpu")) == "not on CUDA"
