"""``megasparse chunkflow plan`` (``chunkflow/report.py``): the plan's fill, padding and recompute on a dataset's
lengths, checked against the planner itself, and the command's output and one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from megasparse.chunkflow.plan import plan_step
from megasparse.chunkflow.report import format_plan_report, main, plan_report


def _lengths(n: int = 400, seed: int = 0) -> np.ndarray:
    """A long tail: mostly short documents, some of several chunks of 64."""
    rng = np.random.default_rng(seed)
    short = rng.integers(3, 40, n)
    return np.where(rng.random(n) < 0.08, rng.integers(100, 300, n), short)


def test_report_matches_the_planner_and_tails_fill_more() -> None:
    lengths = _lengths()
    rep = plan_report(lengths, 64, keep=2, per_step=32, steps=1, seed=5)
    drawn = [int(x) for x in np.random.default_rng(5).choice(lengths, 32, replace=False)]
    for tails in (True, False):
        r = rep["layouts"][f"pack_tails={str(tails).lower()}"]
        plan = plan_step(drawn, 64, 1, pack=True, tails=tails)
        assert r["fill"] == plan.real_tokens / plan.slots and r["chunks_per_step"] == plan.num_chunks
        extra = sum(max(0, len(g.chunks) - 2) for g in plan.groups)
        assert r["extra_forwards_per_step"] == extra
        assert r["work_per_real"] == pytest.approx((plan.slots + extra * 64 / 3) / plan.real_tokens)
        assert r["padding_long_tails"] + r["padding_packed"] == pytest.approx(1 - r["fill"])
    on, off = rep["layouts"]["pack_tails=true"], rep["layouts"]["pack_tails=false"]
    assert on["fill"] > off["fill"] and on["padding_long_tails"] < off["padding_long_tails"]
    # K at least the longest sequence's chunks: nothing reruns, the work is the padding alone
    whole = plan_report(lengths, 64, keep=rep["longest_chunks"], per_step=32, steps=3)["layouts"]["pack_tails=true"]
    assert whole["extra_forwards_per_step"] == 0 and whole["work_per_real"] == pytest.approx(1 / whole["fill"])


def test_command_prints_both_layouts_and_fails_in_one_line(tmp_path, capsys) -> None:
    from megasparse.data.indexed import write_indexed

    write_indexed(tmp_path / "d", [np.append(np.arange(1, n), 0) for n in _lengths(120)])
    prefix = str(tmp_path / "d")
    assert main(["plan", prefix, "--chunk-size", "64", "--per-step", "16", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "pack_tails=true" in out and "pack_tails=false" in out and "chunks of 64" in out
    assert "pack_tails is on by default where" in out  # measured faster on four GPUs with flex (decision 1248)
    rep = plan_report(np.array([3, 5, 12, 1]), 8, per_step=2, steps=1)  # a 1-token document trains nothing
    assert rep["documents"] == 3 and format_plan_report(rep).count("\n") == 6  # title, header, rule, 2 rows, 2 notes
    for bad, says in ((["--chunk-size", "0"], "--chunk-size=0 must be >= 1"), (["--chunk-size", "64", "--per-step",
                      "1000"], "more than the dataset's")):  # fmt: skip
        assert main(["plan", prefix, *bad]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
