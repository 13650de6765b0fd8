"""torchrun --max-restarts recovers a job after a rank is SIGKILLed: the restarted attempt joins a fresh
per-attempt store, resumes (checkpoint.resume=auto) and ends with the same per-step losses as an
uninterrupted run, each step once in metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
OVERRIDES = [
    "data.prefix=synthetic",  # the cpu_toy model (TP=2) on synthetic tokens: no corpus to build
    "model.vocab_size=256",
    "model.num_layers=2",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "checkpoint.save_interval=1",
    "checkpoint.resume=auto",
    "parallel.backend=gloo",
    "logging.log_interval=1",
]
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun(out: Path, restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [f"--max-restarts={restarts}", "--monitor-interval=0.2", "-m", "megasparse", "train"]
    cmd += [str(REPO / "configs" / "cpu_toy.yaml"), *OVERRIDES, f"logging.out_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"duplicated or unordered steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def workers(parent: int) -> dict[int, int]:
    """LOCAL_RANK -> PID of torchrun's worker processes."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            for kv in env:
                if kv.startswith(b"LOCAL_RANK="):
                    found[int(kv.split(b"=", 1)[1])] = int(d.name)
    return found


def last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def test_sigkill_one_rank_torchrun_restarts_and_matches(tmp_path):
    ref = tmp_path / "ref"
    p = torchrun(ref, 0)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    expected = losses(ref)
    assert sorted(expected) == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    p = torchrun(out, 1)
    deadline = time.time() + 240
    while last_step(out) < 2 and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    ranks = workers(p.pid)
    assert p.poll() is None and 1 in ranks, "the run ended before the kill; make it longer"
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = last_step(out)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    assert killed_at < STEPS
    assert "resumed from" in log, log[-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in expected:
        assert abs(got[s] - expected[s]) <= 1e-6 * abs(expected[s]), (s, got, expected)
