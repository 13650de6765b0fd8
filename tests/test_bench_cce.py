"""benchmarks/bench_cce.py's GEMM floors and interleaved rounds, on CPU at a tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_cce  # noqa: E402

from megasparse.loss import cce_gemm  # noqa: E402


def _inputs():
    return bench_cce.make_inputs(64, 600, 32, dtype=torch.float32, dev="cpu")


def test_floors_compute_the_gemms_of_a_loss(monkeypatch):
    h, w, _ = _inputs()
    # the chunked floor over CCE's P chunks: here 256 columns a chunk, so two full chunks and a narrower last one
    monkeypatch.setattr(cce_gemm, "P_BYTES", 64 * 4 * 256)
    outs = {}
    for name in bench_cce.FLOORS:
        run, de, dc = bench_cce.floor_runner(name, h, w)
        run()
        outs[name] = (de, dc)
    p = h @ w.t()  # the floors' P is the logits themselves: the GEMMs' cost, not the loss's values
    for name, (de, dc) in outs.items():
        torch.testing.assert_close(de, p @ w, rtol=1e-4, atol=1e-3, msg=name)
        torch.testing.assert_close(dc, p.t() @ h, rtol=1e-4, atol=1e-3, msg=name)


def test_rounds_interleave_shuffle_and_take_median_ratios(monkeypatch):
    h, w, t = _inputs()
    cce, tch = "megasparse-cce", "torch-materialised"
    times = {cce: [9.0, 11.0, 30.0, 12.0], tch: [10.0, 10.0, 20.0, 10.0]}  # by round, whatever the order
    order = []
    real = bench_cce.fwd_bwd_runner

    def runner(name, *a):
        run, hh, ww = real(name, *a)

        def tagged():
            order.append(name)
            run()  # the runner itself runs: a CPU loss, forward and backward

        return tagged, hh, ww

    def fake_bench_ms(fn):
        fn()
        return times[order[-1]][(len(order) - 1) // 2]

    monkeypatch.setattr(bench_cce, "fwd_bwd_runner", runner)
    monkeypatch.setattr(bench_cce, "bench_ms", fake_bench_ms)
    rows = []
    out = bench_cce.rounds(h, w, t, "tiny", 4, (cce, tch), rows)
    rounds = [order[i : i + 2] for i in range(0, 8, 2)]
    assert all(sorted(r) == sorted([cce, tch]) for r in rounds)  # each round times each method once
    assert len({tuple(r) for r in rounds}) == 2  # and the order changes between rounds
    by = {r["method"]: r for r in out}
    assert by[cce]["ms_each"] == times[cce] and by[tch]["ms_each"] == times[tch]
    row = by[cce]
    assert row["ms"] == 11.5 and (row["ms_min"], row["ms_max"]) == (9.0, 30.0)
    # each round's ratio: 0.9, 1.1, 1.5, 1.2; their median 1.15 (not 11.5 / 10, the ratio of the medians)
    assert row["ratio_vs_torch"] == pytest.approx(1.15)
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.5))
    assert by[tch]["ratio_vs_torch"] == 1.0
    assert rows == out
