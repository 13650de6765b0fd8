"""Issue 32 (docs/reliability.md): preemption saves, one run per directory, failures that name their cause, and
no silent acceptance. Each case asserts the exit status (or the exception), the one line, and that the files an
earlier run left did not change."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_distributed
from test_reliability import _DIST_ENV, TINY, strict_lines
from test_restart import workers

from megasparse.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def snapshot(d: Path) -> dict[str, str]:
    """Every file under ``d`` with its content hash (what "no earlier file changed" compares)."""
    files = sorted(p for p in d.rglob("*") if p.is_file())
    return {str(p.relative_to(d)): hashlib.sha1(p.read_bytes()).hexdigest() for p in files}


def _main(argv: list[str]) -> int:
    from megasparse.train import main

    return main(argv)


def train_here(capsys, *args: str) -> tuple[int, str]:
    """``megasparse train ARGS`` in this process (no interpreter start-up): exit status and the last stderr line."""
    capsys.readouterr()
    rc = run_distributed(_main, 1, [*TINY, *args])[0]
    return rc, last_line(capsys.readouterr().err)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run with step-1 and step-2 checkpoints (copied by each test that needs one)."""
    out = tmp_path_factory.mktemp("finished")
    args = [*TINY, "train.steps=2", "checkpoint.save_interval=1", "checkpoint.keep_last=3", f"logging.out_dir={out}"]
    assert run_distributed(_main, 1, args)[0] == 0  # in this process: no interpreter start-up
    assert not (out / "megasparse.lock").exists(), "the lock outlived its run"
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, limit: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        m = out / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps after {limit} s")


# ------------------------------------------------------------------------------------------------- signals
def test_sigterm_saves_then_resume_continues(tmp_path, capsys):
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    cmd = [sys.executable, "-m", "megasparse", "train", *TINY, "train.steps=100000", f"logging.out_dir={tmp_path}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_steps(tmp_path, 3, p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, err[-2000:]
    line = last_line(err)
    assert line.startswith("megasparse: stopped by SIGTERM after step "), line
    step = int(line.split("after step ")[1].split(":")[0])
    assert f"saved {tmp_path / 'checkpoints' / f'step-{step}'}; relaunch with checkpoint.resume=auto" in line
    assert not (tmp_path / "megasparse.lock").exists()
    before = snapshot(tmp_path / "checkpoints")
    capsys.readouterr()
    rc = run_distributed(_main, 1, [*TINY, f"train.steps={step + 1}", "checkpoint.resume=auto",
                                    f"logging.out_dir={tmp_path}"])[0]  # fmt: skip
    assert rc == 0
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{step}'}" in capsys.readouterr().out
    assert [x["step"] for x in strict_lines(tmp_path / "metrics.jsonl")] == list(range(1, step + 2))
    after = snapshot(tmp_path / "checkpoints")
    assert all(after[k] == v for k, v in before.items() if k.startswith(f"step-{step}/")), "the resume changed it"


@pytest.mark.slow
def test_signal_to_one_rank_under_torchrun_saves_on_all(tmp_path):
    """SIGUSR1 (checkpoint.signal) reaches only rank 1: the ranks agree at the step boundary and both save."""
    _signal_one_rank(tmp_path, TINY)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_signal_to_one_rank_nccl_saves_on_all(tmp_path):
    """The same on 2 GPUs over NCCL: the flag all-reduce runs on the device (bf16, CUDA graphs on)."""
    gpu = [o for o in TINY if not o.startswith(("train.device", "train.dtype", "parallel.backend"))]
    _signal_one_rank(tmp_path, gpu + ["train.device=cuda", "train.dtype=bf16", "parallel.backend=nccl"])


def _signal_one_rank(tmp_path: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval=0.2", "-m", "megasparse", "train", *overrides, "train.steps=100000",
           "checkpoint.signal=SIGUSR1", f"logging.out_dir={tmp_path}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wait_for_steps(tmp_path, 2, p)
    os.kill(workers(p.pid)[1], signal.SIGUSR1)
    log, _ = p.communicate(timeout=120)
    lines = [ln for ln in log.splitlines() if "megasparse: stopped by SIGUSR1 after step" in ln]
    assert len(lines) == 1, log[-3000:]
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert "exitcode: 75" in log or "exit code: 75" in log.lower(), log[-3000:]
    from megasparse import checkpoint as ckpt

    where = tmp_path / "checkpoints" / f"step-{step}"
    ckpt.verify_checksums(where)
    assert json.loads((where / "layout.json").read_text())["dp"] == 2
    assert [x["step"] for x in strict_lines(tmp_path / "metrics.jsonl")] == list(range(1, step + 1))


def _signal_mid_save(out: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from megasparse import checkpoint as ckpt
    from megasparse.preempt import Preempted
    from megasparse.train import Trainer

    real = dcp.save

    def interrupted_save(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the middle of the save
        os.kill(os.getpid(), signal.SIGINT)  # a second signal (Ctrl-C) during a save does not abort it either
        return real(*a, **k)

    dcp.save = interrupted_save
    try:
        cfg = load_config(None, TINY + ["train.steps=50", "checkpoint.save_interval=2", f"logging.out_dir={out}"])
        Trainer(cfg).fit()
        line = ""
    except Preempted as e:
        line = e.line
    finally:
        dcp.save = real
    root = Path(out) / "checkpoints"
    ckpt.verify_checksums(root / "step-2")
    return {"line": line, "names": sorted(p.name for p in root.iterdir()), "sigint": signal.getsignal(signal.SIGINT)}


def test_signal_during_save_lets_it_finish(tmp_path):
    r = run_distributed(_signal_mid_save, 1, str(tmp_path))[0]
    assert r["line"].startswith("stopped by SIGTERM after step 2: its checkpoint was just saved"), r["line"]
    assert r["names"] == ["order.txt", "step-2"]  # finished and renamed; no .tmp-step-2 left
    assert r["sigint"] is signal.default_int_handler  # handlers restored after the run


# ---------------------------------------------------------------------------------------- one run per dir
def test_lock_refuses_a_second_run(tmp_path, capsys):
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "start": "2026-01-01 00:00:00 UTC", "job": ""}
    (tmp_path / "megasparse.lock").write_text(json.dumps(lock))
    before = snapshot(tmp_path)
    rc, line = train_here(capsys, "train.steps=2", f"logging.out_dir={tmp_path}")
    assert rc == 2, line
    assert line.startswith(f"megasparse: error: logging.out_dir={tmp_path} is in use by another run (host "), line
    assert f"pid {os.getpid()}" in line and snapshot(tmp_path) == before


def test_stale_locks_are_taken_over(tmp_path, monkeypatch):
    from megasparse import rundir

    dead = subprocess.Popen(["true"])
    dead.wait()
    cases = {  # holder -> stale?
        "dead pid here": ({"host": socket.gethostname(), "pid": dead.pid, "job": ""}, 0, True),
        "same job": ({"host": "elsewhere", "pid": 1, "job": "4242"}, 0, True),
        "old heartbeat": ({"host": "elsewhere", "pid": 1, "job": ""}, rundir.STALE_S + 60, True),
        "alive elsewhere": ({"host": "elsewhere", "pid": 1, "job": ""}, 0, False),
    }
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    for name, (held, age, stale) in cases.items():
        lk = rundir.RunLock(tmp_path)
        lk.path.write_text(json.dumps(held))
        os.utime(lk.path, (time.time() - age, time.time() - age))
        said = []
        if stale:
            lk.acquire(said.append)
            assert lk.held and "taking over the stale lock" in said[0], name
            assert json.loads(lk.path.read_text())["pid"] == os.getpid()
            lk.release()
            assert not lk.path.exists()
        else:
            with pytest.raises(ConfigError, match="is in use by another run"):
                lk.acquire(said.append)


def test_fresh_run_into_a_used_dir_refuses_or_moves_aside(finished, tmp_path, capsys):
    from megasparse import rundir

    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out)
    rc, line = train_here(capsys, "train.steps=2", f"logging.out_dir={out}")
    assert rc == 2, line
    assert "already holds a run (checkpoints/, metrics.jsonl) and checkpoint.resume is not set" in line, line
    assert "checkpoint.resume=auto" in line and "logging.previous_run=move_aside" in line
    assert snapshot(out) == before
    said = []
    rundir.refuse_or_move_previous(out, "move_aside", said.append)
    moved = next(out.glob("previous-*"))
    assert "moved the previous run's" in said[0]
    assert snapshot(moved) == before and rundir.previous_run(out) == []  # moved whole, nothing deleted


# ------------------------------------------------------------------------------------- failures named
def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # a shard of this model is ~250 KB


def test_disk_full_mid_save_names_the_os_error(finished, tmp_path):
    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out / "checkpoints")
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    r = subprocess.run(
        [sys.executable, "-m", "megasparse", "train", *TINY, "train.steps=3", "checkpoint.resume=auto",
         f"logging.out_dir={out}"],
        capture_output=True, text=True, env=env, timeout=120, preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    line = last_line(r.stderr)
    assert line.startswith("megasparse: error: cannot write the checkpoint "), line
    assert "File too large (EFBIG); the previous checkpoint is untouched" in line, line
    assert snapshot(out / "checkpoints") == before  # step-1, step-2 and order.txt as they were, no .tmp-step-3


def test_disk_full_on_a_small_tmpfs_names_enospc(tmp_path, capsys):
    """A real full filesystem: a 400 KiB tmpfs holds one checkpoint of this model (~270 KB), not two."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        out = mnt / "run"
        rc, line = train_here(capsys, "train.steps=4", "checkpoint.save_interval=1", f"logging.out_dir={out}")
        assert rc == 2, line
        tmp = out / "checkpoints" / ".tmp-step-2"
        assert line == (f"megasparse: error: cannot write the checkpoint {tmp}: No space left on device (ENOSPC); "
                        "the previous checkpoint is untouched")  # fmt: skip
        from megasparse import checkpoint as ckpt

        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["order.txt", "step-1"]
        ckpt.verify_checksums(out / "checkpoints" / "step-1")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: the metrics file may be open


def test_storage_checked_at_start(tmp_path):
    from megasparse import rundir

    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(rundir.StorageError, match="checkpoint directory .* is not a directory"):
        rundir.check_storage(tmp_path, 1, True)
    (tmp_path / "checkpoints").unlink()
    with pytest.raises(rundir.StorageError, match=r"not enough space for a checkpoint in .*GiB free"):
        rundir.check_storage(tmp_path, 1 << 62, True)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(rundir.StorageError, match="is a dangling symlink"):
        rundir.check_storage(tmp_path / "link", 1, True)
    with pytest.raises(rundir.StorageError, match=r"cannot write to logging.out_dir /proc/megasparse-run: "):
        rundir.check_storage(Path("/proc/megasparse-run"), 1, True)


def _timeout_case(out: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from megasparse import runguard
    from megasparse.parallel import state
    from megasparse.train import Trainer

    # the default group waits long (the ranks start at different times); megatron-core's groups get 2 s
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    state.init(1, 1, False, "gloo", timeout_s=2)
    tr = Trainer(load_config(None, TINY + [f"logging.out_dir={out}"]), init_groups=False)
    dist.barrier()  # the default group (120 s): both ranks built, so rank 0 waits the full sleep below
    if dist.get_rank() == 1:
        time.sleep(5)  # hung, as far as rank 0 can tell
    runguard.doing("training step 1")
    t0 = time.time()
    try:
        tr.train_step()
        return {"line": "", "s": time.time() - t0}
    except Exception as e:  # noqa: BLE001
        return {"line": runguard.failure_line(e, dist.get_rank(), 2), "s": time.time() - t0}


@pytest.mark.slow
def test_collective_timeout_names_rank_and_step(tmp_path):
    r0 = run_distributed(_timeout_case, 2, str(tmp_path))[0]
    assert r0["line"].startswith("rank 0 timed out after 2 s (parallel.timeout_minutes) while training step 1"), r0
    assert r0["s"] < 10, r0  # the data-parallel (megatron-core) group's timeout, not its 30-minute default


def test_new_keys_are_checked_before_any_group():
    with pytest.raises(ConfigError, match="parallel.timeout_minutes=0.0 must be > 0"):
        load_config(None, TINY + ["parallel.timeout_minutes=0"]).validate(1)
    with pytest.raises(ConfigError, match="checkpoint.signal=SIGKILL is not a signal this process can catch"):
        load_config(None, TINY + ["checkpoint.signal=SIGKILL"]).validate(1)
    for ok in ("USR2", "SIGUSR1", "none", "12"):
        load_config(None, TINY + [f"checkpoint.signal={ok}"]).validate(1)


# ----------------------------------------------------------------------------------- no silent acceptance
def test_nan_sidecar_is_one_line(tmp_path):
    from megasparse.filtering.sidecar import SidecarError, gather_ref_losses

    f = tmp_path / "ref.bin"
    np.array([1.0, 2.0, np.nan, 4.0], dtype=np.float32).tofile(f)
    side = np.memmap(f, mode="r", dtype=np.float32)
    assert gather_ref_losses(side, torch.tensor([0, 1, 3])).tolist() == [1.0, 2.0, 4.0]
    nonfinite = r"ref.bin: non-finite reference losses \(NaN/inf\) at .bin token offsets \[2\]"
    with pytest.raises(SidecarError, match=nonfinite):
        gather_ref_losses(side, torch.tensor([[0, 2], [3, -1]]))


def test_resume_that_changes_the_data_order_is_refused(finished, tmp_path, capsys):
    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out)
    rc, line = train_here(capsys, "train.steps=4", "checkpoint.resume=auto", "model.seq_length=16",
                          "train.global_batch_size=8", f"logging.out_dir={out}")  # fmt: skip
    assert rc == 2, line
    assert "step-2 would change the data order or the optimisation: model.seq_length 8 -> 16; " in line, line
    assert "train.global_batch_size 4 -> 8; resume with the saved values, or set checkpoint.accept_changes" in line
    assert snapshot(out) == before


def _resume_cases(out: str) -> dict:
    from megasparse.train import Trainer

    said = {}
    cases = {
        "done": ["train.steps=2", f"checkpoint.resume={out}"],
        "done_auto": ["train.steps=2", "checkpoint.resume=auto"],
        "accepted": ["optim.lr=1e-3", "checkpoint.accept_changes=true", "train.steps=3", "checkpoint.resume=auto"],
    }
    for name, extra in cases.items():
        cfg = load_config(None, TINY + extra + [f"logging.out_dir={out}"])
        try:
            said[name] = len(Trainer(cfg, init_groups=name == "done").fit())
        except ConfigError as e:
            said[name] = str(e)
    return said


def test_resume_step_and_accepted_changes(finished, tmp_path, capsys):
    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out / "checkpoints")
    r = run_distributed(_resume_cases, 1, str(out))[0]
    assert r["done"].startswith("train.steps=2 but ") and "is already at step 2: nothing to run" in r["done"], r
    assert r["done_auto"] == 0  # a requeue of a finished run: a note, nothing run, exit 0
    assert r["accepted"] == 1  # one more step after the announced change
    said = capsys.readouterr().out
    assert "step-2 is already at step 2 >= train.steps=2: nothing to run; raise train.steps" in said
    assert "checkpoint.accept_changes=true: continuing step-2 with optim.lr 0.003 -> 0.001" in said
    assert all(snapshot(out / "checkpoints").get(k) == v for k, v in before.items() if k.startswith("step-2/"))


def test_resume_auto_skips_a_corrupt_latest(finished, tmp_path):
    from megasparse import checkpoint as ckpt

    out = copy_run(finished, tmp_path / "run")
    shard = next((out / "checkpoints" / "step-2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = snapshot(out)
    said = []
    assert Path(ckpt.resume_target("auto", out, said.append)).name == "step-1"
    assert said[0].startswith("checkpoint.resume=auto: skipping step-2: checkpoint ") and "CRC32" in said[0]
    assert snapshot(out) == before


def test_unreadable_config_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; give a YAML file"):
        load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"train:\n  steps: 3\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 18\)"):
        load_config(bad)


def test_suspicious_settings_warn_in_one_line():
    from megasparse.runguard import warnings

    cfg = load_config(None, TINY + ["train.steps=5", "optim.warmup_steps=5", "data.ref_losses=x.bin"])
    assert warnings(cfg) == [
        "data.ref_losses is set but filter.mode=off: the reference losses are not read",
        "optim.warmup_steps=5 >= train.steps=5: the learning rate never reaches optim.lr=0.003",
    ]


FAILING_RANK = """import os, sys
from megasparse import train
if os.environ["RANK"] == "1":
    real = train.Trainer.train_step
    def broken(self):
        if self.step == 2:
            raise ValueError("rank 1's own bug")
        return real(self)
    train.Trainer.train_step = broken
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_failed_rank_under_torchrun_is_named_last(tmp_path):
    """Rank 1 raises at step 3: its line is the last megasparse line and torchrun's Root Cause names rank 1 (rank 0,
    which only lost its peer, stays quiet)."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--monitor-interval=0.2", str(script), *TINY, "train.steps=6", f"logging.out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    ours = [ln for ln in log.splitlines() if ln.startswith("megasparse: error:")]
    assert ours[-1] == "megasparse: error: rank 1 failed while training step 3: ValueError: rank 1's own bug", ours
    root = log.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1" in root, root


def test_failure_lines_name_rank_and_activity(capsys):
    """main()'s report: a rank's own error last with its traceback; a rank that only lost its peer stays silent once
    the launcher's stop signal came (the failed rank has spoken); a timeout names the limit."""
    from megasparse import runguard

    runguard.doing("training step 3")
    try:
        raise ValueError("bad value")
    except ValueError as e:
        assert runguard.report_failure(e, 600, False) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "megasparse: error: rank 0 failed while training step 3: ValueError: bad value"
    assert "Traceback" in err
    peer = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8067")
    assert runguard.report_failure(peer, 600, True) == 1 and capsys.readouterr().err == ""
    line = runguard.failure_line(RuntimeError("Timed out waiting 600000ms for recv operation"), 3, 600)
    assert line.startswith("rank 3 timed out after 600 s (parallel.timeout_minutes) while training step 3: ")


def test_out_of_memory_is_one_line_with_the_memory_keys(capsys):
    """A rank out of GPU memory is not a bug: no traceback, one line with torch's first line (how much it tried to
    allocate) and the keys that trade speed for memory."""
    from megasparse import runguard

    runguard.doing("training step 1")
    try:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity\nof 79 GiB"
        )
    except torch.OutOfMemoryError as e:
        assert runguard.report_failure(e, 600, False) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    line = err.splitlines()[0]
    assert line.startswith("megasparse: error: rank 0 ran out of GPU memory while training step 1 [CUDA out of memory.")
    for key in ("train.micro_batch_size", "model.recompute=selective", "megasparse plan"):
        assert key in line, key
