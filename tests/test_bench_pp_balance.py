"""benchmarks/bench_pp_balance.py runs its three layouts end to end on 2 gloo ranks and they train alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_pp_balance_runs_all_cases(tmp_path):
    out = tmp_path / "ppb.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(REPO / "benchmarks" / "bench_pp_balance.py"), "configs/cpu_toy.yaml",
        "parallel.tp=1", "parallel.pp=2", "data.prefix=synthetic", "model.vocab_size=1000", "model.num_layers=3",
        "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "--steps", "2", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    cases = {c["case"]: c for c in rep["cases"]}
    assert set(cases) == {"last", "planned", "vocab_pp"}
    for c in cases.values():
        assert sum(c["layers_per_stage"]) == 3 and c["step_ms"] > 0
    # same seed, same data, same maths: every layout reaches the same loss
    losses = [c["final_loss"] for c in cases.values()]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
    # vocabulary over the pipeline: both stages hold the same vocabulary rows (the layers differ by one)
    assert cases["vocab_pp"]["params_m_per_stage"][0] != cases["last"]["params_m_per_stage"][0]
    assert "pipeline balance" in r.stdout
