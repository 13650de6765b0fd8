"""Smoke test of benchmarks/bench_sparse24_block.py --small: the CPU run of the script the lead runs on a GPU.

It runs the real script in a subprocess (it creates a process group) and checks what the GPU run relies on:
the correctness check is discriminative, mask refreshes land inside the timed windows at the configured
cadence, the trainer-level refresh steps really refresh, and the table comes last.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_sparse24_block.py"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bsb") / "bench.json"
    # the script makes its own one-rank group: a rank/port left in the environment by an earlier test of the same
    # session (a module fixture's process group) must not be inherited
    rank_env = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rank_env}
    env.update(OMP_NUM_THREADS="1", OUT=str(out.parent))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_check_is_discriminative(small_run):
    res, _ = small_run
    assert res["ok"] and not res["notes"]
    assert [c["block"] for c in res["checks"]] == ["1b", "llama3-8b"]
    for c in res["checks"]:
        assert c["ok"]
        for key, err in c["rel"].items():
            assert err <= 1e-5, (c["block"], key, err)  # fp32 emulate on both sides: same math
            assert c["control_unmasked_rel"][key] > 0.1  # unmasked weights are far off: the check can fail
        assert not any(p["cusparselt"] for p in c["plans"].values())  # CPU: masked-dense path


def test_block_windows_contain_refreshes(small_run):
    res, _ = small_run
    assert len(res["block"]) == 2
    for b in res["block"]:
        sp, dn = b["sparse"], b["dense"]
        assert sp["refresh_steps"] == [40] and dn["refresh_steps"] == []
        assert len(sp["ms"]) == len(dn["ms"]) == 40
        assert sp["steps"] == list(range(4, 44))  # check step 1, warm-up 2..3, then training-numbered steps
        assert b["sparse_ms"] == pytest.approx(sp["steady_ms"] + sp["refresh_excess_ms"] / 40)
        assert b["speedup"] == pytest.approx(b["dense_ms"] / b["sparse_ms"])
        assert all(math.isfinite(x) and x > 0 for x in sp["ms"] + dn["ms"])
        assert b["tokens"] == 64 * 2


def test_e2e_refresh_steps_really_refresh(small_run):
    res, _ = small_run
    (row,) = res["e2e"]
    d, s = row["dense"], row["sparse"]
    assert s["refreshed_at"] == [40] and d["refreshed_at"] == []
    assert len(s["refresh_excess_ms"]) == 1
    assert s["finite"] and d["finite"]
    assert s["step_ms"] == pytest.approx(s["steady_ms"] + s["refresh_excess_ms"][0] / 40)
    assert row["speedup"] == pytest.approx(d["step_ms"] / s["step_ms"])
    for r in (d, s):  # a freshly initialised model predicts near-uniformly over the 512-token vocabulary
        assert abs(r["losses"][0] - math.log(512)) < 0.5
    assert set(s["plans_layer0"]) == {"fc1", "fc2"}


def test_table_printed_last(small_run):
    res, stdout = small_run
    tail = stdout.strip().splitlines()
    start = max(i for i, line in enumerate(tail) if line.startswith("2:4 sparse FFN: block and trainer step"))
    assert "| cpu | torch" in tail[start]
    assert tail[-1].endswith("overall OK")
    assert sum(line.startswith(("1b ", "llama3-8b ")) for line in tail[start:]) == 2
