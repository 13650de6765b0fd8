"""Which runs capture CUDA graphs (``cudagraph.capture_blocker`` asking the run's components), decided from the config
alone: no device needed.

Pipeline stages under plain 1F1B capture (one graph pair per in-flight slot); the interleaved schedule, lock-step
vocabulary over the pipeline and selections whose per-SP-rank row count depends on the data stay eager and say why.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny

from megasparse.config import load_config
from megasparse.cudagraph import capture_blocker
from megasparse.step.build import components_for_capture_check

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated
_COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]
_MB1 = ["train.micro_batch_size=1"]


def _blocker(*overrides: str, pp: int = 2) -> str | None:
    cfg = load_config(None, tiny(model__num_layers=4) + [f"parallel.pp={pp}", *overrides])
    return capture_blocker(cfg, pp, CUDA, components_for_capture_check(cfg))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        _COLLIDER,
        _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true"],
        _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=1"],
        _COLLIDER + ["filter.granularity=microbatch", "train.micro_batch_size=1"],  # one sequence, no SP: static
        _COLLIDER + ["filter.granularity=shard", "parallel.tp=2", "parallel.sequence_parallel=true"] + _MB1,
        ["loss.impl=cce", "sparsity.enabled=true"],
    ],
)
def test_plain_1f1b_stages_capture(overrides: list[str]) -> None:
    assert _blocker(*overrides) is None


def test_fp8_is_asked_and_captures() -> None:
    """The fp8 converter is one of the components cudagraph asks, and it does not block capture."""
    from megasparse.fp8.converter import Fp8Converter

    cfg = load_config(None, tiny(model__num_layers=4) + ["parallel.pp=2", "train.fp8=tensorwise"])
    parts = components_for_capture_check(cfg)
    assert [type(c) for c in parts if isinstance(c, Fp8Converter)] == [Fp8Converter]
    assert capture_blocker(cfg, 2, CUDA, parts) is None


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["parallel.virtual_stages=2", "train.global_batch_size=8"], "parallel.virtual_stages"),
        (["loss.vocab_over_pp=true"], "vocab_over_pp"),
        (
            _COLLIDER + ["parallel.tp=2", "parallel.sequence_parallel=true", "filter.granularity=sequence"],
            "filter.granularity=sequence under SP",
        ),
        (_COLLIDER + ["filter.granularity=microbatch"], "at micro_batch_size > 1"),  # per-sequence counts on the host
        (_COLLIDER + ["filter.granularity=shard"], "at micro_batch_size > 1"),
        (_COLLIDER[:-1] + ["filter.scorer=random"], "filter.scorer=random"),
        (["train.cuda_graphs=false"], "train.cuda_graphs=false"),
    ],
)
def test_stages_that_stay_eager_say_why(overrides: list[str], says: str) -> None:
    why = _blocker(*overrides)
    assert why is not None and says in why, why


@pytest.mark.parametrize("granularity", ["microbatch", "shard"])
def test_host_read_selections_stay_eager_at_pp1_too(granularity: str) -> None:
    """Per-sequence counts read on the host break a single-stage capture as well (it used to fail and fall back)."""
    assert "micro_batch_size > 1" in _blocker(*_COLLIDER, f"filter.granularity={granularity}", pp=1)
    assert _blocker(*_COLLIDER, f"filter.granularity={granularity}", *_MB1, pp=1) is None


def test_cpu_runs_stay_eager() -> None:
    cfg = load_config(None, tiny(model__num_layers=4) + ["parallel.pp=2"])
    assert capture_blocker(cfg, 2, torch.device("cpu"), components_for_capture_check(cfg)) == "not on CUDA"


class _Operands:
    """Stands in for the 2:4 converter: ``prepare_replay`` names the buffers its GEMMs read (moved by ``move``)."""

    def __init__(self) -> None:
        self.version = 0

    def move(self) -> None:
        self.version += 1

    def capture_blocker(self) -> None:
        return None

    def prepare_replay(self) -> tuple:
        return (("fc1", self.version),)


class _Captured:
    """Stands in for StageGraphs (CUDA-only): counts captures, hands itself to the schedule."""

    made = 0

    def __init__(self, *args) -> None:
        type(self).made += 1
        self.slots, self.last = [0], True

    def start(self, batches, step):
        return self

    def release(self) -> None:
        pass


def _stage_steps(monkeypatch, moves: set[int], steps: int) -> tuple[list[str], object]:
    """What ``CapturedSteps.stage`` does on each step at pp = 2 when the 2:4 operands move on ``moves``."""
    from megasparse import cudagraph

    ops = _Operands()
    monkeypatch.setattr(cudagraph, "StageGraphs", _Captured)
    _Captured.made = 0
    cfg = load_config(None, tiny(model__num_layers=4) + ["parallel.pp=2"])
    cs = cudagraph.CapturedSteps(cfg, 2, CUDA, torch.nn.Linear(2, 2), [ops])
    seen, made = [], 0
    for step in range(steps):
        if step in moves:
            ops.move()
        got = cs.stage([None], None, None, step)
        seen.append("eager" if got is None else ("capture" if _Captured.made > made else "replay"))
        made = _Captured.made
    return seen, cs


def test_stage_warms_up_eagerly_before_each_capture(monkeypatch) -> None:
    seen, cs = _stage_steps(monkeypatch, {4}, 8)
    assert seen == ["eager", "capture", "replay", "replay", "eager", "capture", "replay", "replay"]
    assert cs.blocker is None


def test_stage_gives_up_when_operands_move_every_step(monkeypatch) -> None:
    """Each move costs an eager step, so operands moving on every step would never be replayed: stop trying."""
    seen, cs = _stage_steps(monkeypatch, {1, 2, 3}, 6)
    assert seen == ["eager"] * 6
    assert "every step" in cs.blocker
