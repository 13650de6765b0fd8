"""The step's three parts on their own (``megasparse/step/``): which schedule a config gets, the order a pp = 1
schedule hands micro-batches to its in-flight handler (what the replayed single-stage graph relies on), and what
``MicrobatchStep`` computes for one micro-batch. One process, no groups, well under a second."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny

from megasparse.config import load_config
from megasparse.data.batch import Batch
from megasparse.step.executor import EagerExecutor, ForwardBackward
from megasparse.step.microbatch import MicrobatchStep
from megasparse.step.schedule import get_schedule


@pytest.mark.parametrize(
    ("overrides", "train", "name"),
    [
        ([], True, "1f1b"),
        (["parallel.pp=2"], True, "1f1b"),
        (["parallel.pp=2", "parallel.virtual_stages=2"], True, "interleaved"),
        (["parallel.pp=2", "loss.vocab_over_pp=true"], True, "lockstep"),
        (["parallel.pp=2", "loss.vocab_over_pp=true"], False, "forward-only"),
        (["parallel.pp=2", "parallel.virtual_stages=2"], False, "forward-only"),
    ],
)
def test_get_schedule_follows_the_config(overrides: list[str], train: bool, name: str) -> None:
    assert get_schedule(load_config(None, tiny() + overrides), train).name == name


class _Recorder:
    """An in-flight handler that records the calls a schedule makes (as ``cudagraph.MicrobatchGraph`` receives)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def forward(self, key, mb: int, x):
        self.calls.append(("F", mb))

    def backward(self, key, mb: int, g):
        self.calls.append(("B", mb))


class _NoPeers:
    """A single stage's transfers (``StageComm`` at pp = 1 has no neighbour: every send and receive is a no-op)."""

    chunks = 1

    def __getattr__(self, name: str):
        assert name.startswith(("send_", "recv_")), name
        return lambda *args: None


def _single_stage_comm():
    return _NoPeers()


def test_single_stage_1f1b_runs_forward_then_backward_per_microbatch() -> None:
    """At pp = 1 the captured micro-batch is 1F1B's handler: its forward copies micro-batch i's tokens into the static
    buffer and its backward replays the graph, so the two must alternate in micro-batch order."""
    rec = _Recorder()
    get_schedule(load_config(None, tiny()), True)(3, _single_stage_comm(), rec, rec, None)
    assert rec.calls == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


class _Stage(torch.nn.Module):
    """A one-stage model: per-token loss = (w · id)² over the ids [s, b], flattened s-major."""

    first = last = True

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.keeps: list = []

    @property
    def chunks(self) -> list:
        return [self]

    def forward(self, ids, targets, keep):
        self.keeps.append(keep)
        return (self.w * ids.double()).square().reshape(-1)


class _Filter:
    """Keeps the first row of every micro-batch; records the mb index it is handed (which seeds random scores)."""

    kept_rows = 1

    def __init__(self) -> None:
        self.seen: list[int] = []

    def masked_loss(self, per_tok, batch, keep, step, mb_index):
        self.seen.append(mb_index)
        keep.meta = "filled"
        return per_tok[:1].sum()


def _batches(n: int) -> list[Batch]:
    tokens = torch.arange(n * 2 * 5).reshape(n, 2, 5)  # [b=2, s+1=5] per micro-batch
    return [Batch(t.clone(), None, None) for t in tokens]


@pytest.mark.parametrize("filtered", [False, True])
def test_microbatch_step_loss_normaliser_and_accumulator(filtered: bool) -> None:
    model, tf = _Stage(), (_Filter() if filtered else None)
    ms = MicrobatchStep(model, tf, None, tokens_per_mb=8, num_mb=2, dp=3, dp_rank=1)
    fb = ForwardBackward(load_config(None, tiny()), ms, _single_stage_comm(), EagerExecutor(), torch.device("cpu"))
    batches = _batches(2)
    loss_sum, tokens = fb(batches, True, 7)
    per_tok = [(0.5 * b.ids.double()).square().reshape(-1) for b in batches]
    assert tokens == 16
    assert loss_sum.item() == pytest.approx(sum(p.sum().item() for p in per_tok))  # every token, filtered or not
    # d/dw of (sum of the trained losses) / normaliser, with loss = w²·id², summed over both micro-batches
    trained = [p[:1] if filtered else p for p in per_tok]
    normaliser = (1 if filtered else 8) * 2 * 3
    want = sum((2 * p / 0.5).sum().item() for p in trained) / normaliser
    assert model.w.grad.item() == pytest.approx(want)
    if filtered:
        assert tf.seen == [1, 1 + 3]  # dp_rank + i·dp
        assert [k.meta for k in model.keeps] == ["filled", "filled"]
    else:
        assert all(k.meta is None for k in model.keeps)
