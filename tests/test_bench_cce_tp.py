"""Smoke test of benchmarks/bench_cce_tp.py: 2 gloo ranks on CPU at a tiny size, launched like the GPU run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cce_tp_small_two_ranks(tmp_path):
    out = tmp_path / "bench_cce_tp.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "benchmarks" / "bench_cce_tp.py"),
           "--small", "--sp", "--cpu", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads(out.read_text())
    assert report["tp"] == 2 and report["check_ok"] is True
    # fp32 and bf16, every case (megasparse tp1/tp2/tp2+sp, mcore tp2/tp2+sp, torch tp1) checked against fp64
    assert len(report["checks"]) == 2 * 6 and all(c["ok"] for c in report["checks"])
    assert all(c["pad_dc_max"] == 0.0 for c in report["checks"])
    rows = {r["case"]: r for r in report["rows"]}
    want = ("megasparse-cce tp1", "megasparse-cce tp2", "mcore-materialised tp2", "megasparse-cce tp2+sp",
            "mcore-materialised tp2+sp", "torch-materialised tp1")  # fmt: skip
    assert set(want) <= set(rows)
    for name in want:
        r = rows[name]
        assert r["error"] is None, r["error"]
        assert len(r["ms_per_rank"]) == 2 and all(math.isfinite(x) and x > 0 for x in r["ms_per_rank"])
        assert r["ms"] == max(r["ms_per_rank"])
    tp1 = rows["megasparse-cce tp1"]["ms"]
    for name in ("megasparse-cce tp2", "megasparse-cce tp2+sp"):
        r = rows[name]
        assert r["ratio_vs_ideal"] == pytest.approx(r["ms"] / (tp1 / 2))
        assert r["ratio_vs_mcore"] == pytest.approx(
            r["ms"] / rows[name.replace("megasparse-cce", "mcore-materialised")]["ms"]
        )
        # the timed configuration (filtered, sorted) sharded over 2 ranks gives the TP=1 loss and gradients
        assert r["loss_rel_vs_tp1"] < 1e-5 and r["de_rel_vs_tp1"] < 1e-4 and r["dc_rel_vs_tp1"] < 1e-4
    # the table comes last on stdout and names the device
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("small") and "torch-materialised tp1" in tail[-1]
    assert any(line.startswith("device: cpu x2 (gloo), TP=2") and "check OK" in line for line in tail[-8:])
