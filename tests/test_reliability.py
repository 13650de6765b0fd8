"""Reliability (issue 14, docs/reliability.md): the non-finite guard, checkpoints that never mislead,
strict-JSON metrics without duplicated steps, and the config/launch errors that used to be tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_distributed

from megasparse.config import ConfigError, load_config

TINY = [
    "data.prefix=synthetic",
    "model.vocab_size=64",
    "model.seq_length=8",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.num_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.device=cpu",
    "train.dtype=fp32",
    "train.eval_interval=0",
    "parallel.backend=gloo",
]


def strict_lines(path: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a bare NaN/Infinity fails)."""

    def bad(c):
        raise ValueError(f"non-JSON constant {c}")

    return [json.loads(ln, parse_constant=bad) for ln in path.read_text().splitlines()]


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # a fresh single-process run
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "megasparse", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# ------------------------------------------------------------------------------------- the guard
def _guard_case(out: str) -> dict:
    import torch

    from megasparse.guard import DivergedError
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, TINY + [f"logging.out_dir={out}", "train.max_skipped_steps=2"]))
    good = tr.train_step()
    p0 = next(tr.model.parameters())
    with torch.no_grad():
        p0.view(-1)[0] = float("nan")  # poisons the loss and every gradient from here on
    params = [p.detach().clone() for p in tr.model.parameters()]
    moments = [{k: v.clone() for k, v in tr.optimizer.state[p].items()} for p in tr.model.parameters()]
    r = tr.train_step()
    same_w = all(
        torch.equal(a, b) or torch.allclose(a, b, equal_nan=True) for a, b in zip(params, tr.model.parameters())
    )
    same_m = all(
        all(torch.equal(m[k], tr.optimizer.state[p][k]) for k in m) for m, p in zip(moments, tr.model.parameters())
    )
    saved = tr.save()
    try:
        tr.train_step()
        stopped = ""
    except DivergedError as e:
        stopped = str(e)
    return {
        "good": good.loss,
        "skipped": r.extra.get("skipped"),
        "loss": r.loss,
        "step": tr.step,
        "same_w": same_w,
        "same_m": same_m,
        "saved": saved,
        "stopped": stopped,
    }


def test_guard_skips_nonfinite_step_and_stops(tmp_path):
    r = run_distributed(_guard_case, 1, str(tmp_path))[0]
    assert r["good"] == r["good"] and r["loss"] != r["loss"]  # first finite, second NaN
    assert r["skipped"] == 1 and r["same_w"] and r["same_m"], r
    assert r["saved"] is None and not (tmp_path / "checkpoints").exists(), "a non-finite state was saved"
    assert "2 consecutive steps" in r["stopped"] and "\n" not in r["stopped"]


def test_cli_diverging_run_stops_with_one_line_and_strict_json(tmp_path):
    r = run_cli(
        "train",
        *TINY,
        "train.steps=8",
        "optim.lr=1e37",  # weights ~1e37 after one step: the next forward overflows to NaN
        "optim.warmup_steps=0",
        "optim.grad_clip=0",
        "optim.weight_decay=0",
        "train.max_skipped_steps=3",
        "checkpoint.save_interval=1",
        f"logging.out_dir={tmp_path}",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("megasparse: error: 3 consecutive steps"), last
    recs = strict_lines(tmp_path / "metrics.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3] and recs[-1]["loss"] is None
    assert "update skipped" in r.stdout


# ------------------------------------------------------------------------------------ checkpoints
def _ckpt_case(out: str) -> dict:
    from megasparse import checkpoint as ckpt
    from megasparse.train import Trainer

    ov = TINY + [f"logging.out_dir={out}", "checkpoint.keep_last=3"]
    tr = Trainer(load_config(None, ov))
    root = Path(out) / "checkpoints"
    for _ in range(4):
        tr.train_step()
        tr.save()
    res = {"after4": [p.name for p in ckpt.valid_checkpoints(root)]}
    tr.resume(str(root / "step-2"))  # older than step-3/4: those move aside
    res["resumed_step"] = tr.step
    res["after_resume"] = [p.name for p in ckpt.valid_checkpoints(root)]
    for _ in range(3):
        tr.train_step()
        tr.save()
    res["after_rerun"] = [p.name for p in ckpt.valid_checkpoints(root)]
    res["auto"] = Path(ckpt.resume_target("auto", out)).name
    res["abandoned"] = sorted(
        p.name.rsplit("-", 2)[-2] + "-" + p.name.rsplit("-", 1)[-1] for p in root.glob("abandoned-*")
    )
    # load failures: one line each, naming what mismatched
    errors = {}
    shard = next((root / "step-5").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:164]) + data[164:])
    try:
        tr.resume(str(root / "step-5"))
    except ConfigError as e:
        errors["corrupt"] = str(e)
    shard.unlink()
    try:
        tr.resume(str(root / "step-5"))
    except ConfigError as e:
        errors["missing"] = str(e)
    other = Trainer(load_config(None, ov + ["model.hidden_size=32"]))
    try:
        other.resume(str(root / "step-4"))
    except ConfigError as e:
        errors["shape"] = str(e)
    res["errors"] = errors
    return res


def test_checkpoint_order_set_aside_and_load_errors(tmp_path):
    r = run_distributed(_ckpt_case, 1, str(tmp_path))[0]
    assert r["after4"] == ["step-2", "step-3", "step-4"]
    assert r["resumed_step"] == 2
    assert r["after_resume"] == ["step-2"]
    assert r["abandoned"] == ["step-3", "step-4"]
    # the rerun's own step-3..5 are kept (write order), the next automatic resume picks the newest of them
    assert r["after_rerun"] == ["step-3", "step-4", "step-5"] and r["auto"] == "step-5"
    e = r["errors"]
    assert "corrupted" in e["corrupt"] and "CRC32" in e["corrupt"]
    assert "missing" in e["missing"]
    assert "does not match" in e["shape"] and "size" in e["shape"].lower(), e["shape"]
    assert all("\n" not in v for v in e.values())


def test_pruning_follows_write_order_not_step_number(tmp_path):
    from megasparse import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for name in ("step-8", "step-5", "step-6"):  # written in this order (e.g. a rerun from step-4)
        (root / name).mkdir(parents=True)
        (root / name / ".metadata").write_text("")
    (root / ckpt.ORDER).write_text("step-8\nstep-5\nstep-6\n")
    assert [p.name for p in ckpt.valid_checkpoints(root)] == ["step-8", "step-5", "step-6"]
    assert ckpt.resume_target("auto", tmp_path).endswith("step-6")


def test_metrics_strict_json_and_truncated_on_resume(tmp_path):
    from megasparse.metrics import MetricsLog

    log = MetricsLog(str(tmp_path), True)
    for s in (1, 2, 3, 4):
        log.write({"step": s, "loss": float("nan") if s == 2 else 1.0, "flip_rate": {"all": float("inf")}})
    log.close()
    recs = strict_lines(tmp_path / "metrics.jsonl")
    assert recs[1]["loss"] is None and recs[0]["flip_rate"]["all"] is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    log = MetricsLog(str(tmp_path), True, resume_step=2)
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert [x["step"] for x in strict_lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_cli_resume_auto_fresh_then_continue(tmp_path):
    out = [*TINY, f"logging.out_dir={tmp_path}", "checkpoint.resume=auto", "checkpoint.save_interval=2"]
    r = run_cli("train", *out, "train.steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "checkpoint.resume=auto: no checkpoint" in r.stdout and "starting from step 0" in r.stdout
    full = strict_lines(tmp_path / "metrics.jsonl")
    r = run_cli("train", *out, "train.steps=6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "step-4" in r.stdout
    recs = strict_lines(tmp_path / "metrics.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[:4] == full


# ------------------------------------------------------------------------- config and launch errors
def check(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, TINY + overrides).validate(1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["logging.log_interval=0"], "logging.log_interval=0 must be >= 1"),
        (["train.eval_interval=5", "train.eval_batches=0"], "train.eval_batches=0 must be >= 1"),
        (["optim.grad_clip=-1"], "optim.grad_clip=-1.0 must be >= 0"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
        (["optim.min_lr=-1e-5"], "optim.min_lr=-1e-05 must be >= 0"),
        (["train.max_skipped_steps=0"], "max_skipped_steps=0"),
    ],
)
def test_bad_values_are_one_line(overrides, match):
    check(overrides, match)


def test_cuda_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    check(["train.device=cuda"], "train.device=cuda but CUDA is not available")
    check(["parallel.backend=nccl"], "parallel.backend=nccl needs CUDA")


def test_cpu_runs_pick_gloo():
    """train.device=cpu takes gloo under parallel.backend=auto on any host, and refuses nccl in one line."""
    from megasparse.config import load_config

    assert load_config(None, ["train.device=cpu", "parallel.backend=auto"]).dist_backend() == "gloo"
    assert load_config(None, ["parallel.backend=gloo"]).dist_backend() == "gloo"
    import torch

    if torch.cuda.is_available():  # without CUDA the line above (needs CUDA) comes first
        check(["train.device=cpu", "parallel.backend=nccl"], "cannot carry train.device=cpu tensors")


def test_unwritable_out_dir(tmp_path):
    (tmp_path / "file").write_text("")
    check([f"logging.out_dir={tmp_path}/file/run"], "is not a directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        check([f"logging.out_dir={ro}/run"], "is not writable")
    finally:
        ro.chmod(0o700)


def test_empty_yaml_is_an_error(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)


def test_tensorboard_missing_says_so(tmp_path):
    pytest.importorskip("torch")
    try:
        import torch.utils.tensorboard  # noqa: F401

        have = True
    except ImportError:
        have = False
    r = run_cli("train", *TINY, "train.steps=2", "logging.tensorboard=true", f"logging.out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    if have:
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    else:
        assert "logging.tensorboard=true but the tensorboard package is missing" in r.stderr


def test_torchrun_config_error_printed_once(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "megasparse", "train",
         *TINY, "logging.log_interval=0", f"logging.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k not in _DIST_ENV}, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "megasparse: error:" in ln]
    assert len(lines) == 1 and "logging.log_interval=0" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr.split("megasparse: error:")[0]
