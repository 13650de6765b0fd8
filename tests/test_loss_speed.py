"""loss.impl=auto's speed check (loss/speed.py): the faster loss wins, TP ranks agree, a failed check keeps the
memory rule, and the timed maths really runs (on CPU here; the GPU times with CUDA events, the same passes)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from megasparse.loss import LossConfig, speed


@pytest.fixture(autouse=True)
def _fresh_cache():
    speed._CHOICES.clear()
    yield
    speed._CHOICES.clear()


def _decide(rows: int = 64, group=None) -> tuple[str, str]:
    """The check at a small fixed shape (V_local 40 with 37 real rows, hidden 16); the memory rule said torch."""
    return speed.timed_choice(LossConfig(), rows, 40, 16, torch.bfloat16, "cpu", 37, group, ("materialized", "rule"))


def _choose(monkeypatch, t_torch: float, t_cce: float, rows: int = 64):
    monkeypatch.setattr(speed, "time_loss", lambda impl, *a: t_cce if impl == "cce" else t_torch)
    return _decide(rows)


def test_the_faster_loss_is_chosen_once_per_shape(monkeypatch):
    impl, why = _choose(monkeypatch, t_torch=2e-3, t_cce=1e-3)
    assert impl == "cce" and "cce 1.00 ms, materialised 2.00 ms" in why
    assert _choose(monkeypatch, t_torch=1e-3, t_cce=2e-3) == (impl, why)  # cached: the first call decides
    assert _choose(monkeypatch, t_torch=1e-3, t_cce=2e-3, rows=32)[0] == "materialized"  # another shape: timed again
    assert _choose(monkeypatch, t_torch=1e-3, t_cce=1e-3, rows=16)[0] == "cce"  # a tie: as fast is enough


def test_a_failed_check_keeps_the_memory_rule(monkeypatch):
    def boom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3 GiB")

    monkeypatch.setattr(speed, "time_loss", boom)
    impl, why = _decide()
    assert impl == "materialized"
    assert why.startswith("rule (speed check failed: materialized: OutOfMemoryError: CUDA out of memory")


def test_materialised_logits_that_do_not_fit_choose_cce(monkeypatch):
    """Whole 8B at micro-batch 2 on an H100: the [8192, 128256] fp32 logits ran out of memory in the check and the
    old code then kept the memory rule's materialised loss, which ran out of memory in the step."""

    def timer(impl, *a):
        if impl == "materialized":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
        return 1e-3

    monkeypatch.setattr(speed, "time_loss", timer)
    impl, why = _decide()
    assert impl == "cce" and "the materialised loss failed its speed check" in why and "OutOfMemoryError" in why


@pytest.mark.parametrize("impl", ["materialized", "cce"])
def test_timed_passes_run_the_loss_maths(impl):
    secs = speed.time_loss(impl, LossConfig(), 48, 40, 16, torch.float32, "cpu", 37)
    assert 0 < secs < 5


def _tp_choice(fast_rank: int) -> str:
    """Rank ``fast_rank`` finds cce faster, the other finds it slower: the maxima over TP decide for both."""
    from megasparse.parallel import state

    state.init(2, 1, False, "gloo")
    rank = torch.distributed.get_rank()
    times = {"materialized": 1.0, "cce": 0.5} if rank == fast_rank else {"materialized": 1.0, "cce": 1.5}
    speed.time_loss = lambda impl, *a: times[impl]
    return _decide(group=state.tp_group())[0]


def test_tp_ranks_agree_on_the_loss():
    assert run_distributed(_tp_choice, 2, 0) == [
        "materialized",
        "materialized",
    ]  # cce slower on one shard: slower for the step


def _one_rank_fails() -> tuple[str, str, float]:
    """Rank 1's check runs out of memory, rank 0's finds cce faster: both keep the rule, and the TP group's next
    collective still pairs up (a rank that skipped the agreement would meet the other's check there)."""
    from megasparse.parallel import comm, state

    state.init(2, 1, False, "gloo")
    rank = torch.distributed.get_rank()

    def timer(impl, *a):
        if rank == 1:
            raise torch.OutOfMemoryError("out of memory")
        return {"materialized": 1.0, "cce": 0.5}[impl]

    speed.time_loss = timer
    impl, why = _decide(group=state.tp_group())
    nxt = torch.ones(3)
    comm.all_reduce(nxt, state.tp_group(), "tp")
    return impl, why, float(nxt.sum())


def test_a_check_failing_on_one_rank_falls_back_on_every_rank():
    res = run_distributed(_one_rank_fails, 2)
    assert [r[0] for r in res] == ["materialized", "materialized"] and all(r[2] == 6.0 for r in res)
    assert "on another TP rank" in res[0][1] and "OutOfMemoryError" in res[1][1]


def test_auto_on_cpu_needs_no_check():
    """The check is for CUDA: on CPU auto keeps the memory rule and never times anything."""
    from megasparse.loss import vocab_parallel_loss

    h, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    vocab_parallel_loss(h, w, torch.randint(0, 37, (8,)), LossConfig(), vocab_start=0, vocab_size=37).sum().backward()
    assert speed._CHOICES == {} and w.grad is not None


def test_no_check_without_autograd(monkeypatch):
    """Evaluation and reference scoring (no autograd, varying row counts) keep the memory rule untimed."""
    from megasparse.loss import vocab_parallel_loss

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU: only no_grad stops it
    monkeypatch.setattr(speed, "time_loss", lambda *a: pytest.fail("timed under no_grad"))
    with torch.no_grad():
        h, w = torch.randn(8, 16), torch.randn(40, 16)
        vocab_parallel_loss(h, w, torch.randint(0, 37, (8,)), LossConfig(), vocab_start=0, vocab_size=37)
    assert speed._CHOICES == {}


def test_the_choice_is_printed_once_on_the_first_rank(monkeypatch, capsys):
    """Users see what auto chose (the logger alone is silent in a plain run); other ranks stay quiet."""
    import megasparse.loss as loss_pkg

    reason = "loss.impl=auto -> cce: a test-only reason"
    monkeypatch.setenv("RANK", "0")
    loss_pkg._log_choice(reason)
    loss_pkg._log_choice(reason)
    assert capsys.readouterr().out.count(reason) == 1
    monkeypatch.setenv("RANK", "1")
    loss_pkg._log_choice(reason + " (rank 1)")
    assert capsys.readouterr().out == ""
    # recorded once each, on every rank, for the benchmarks to store beside their numbers
    assert loss_pkg.AUTO_CHOICES.count(reason) == 1 and reason + " (rank 1)" in loss_pkg.AUTO_CHOICES
