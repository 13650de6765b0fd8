"""Run a few training steps with a ``CommRecorder`` active and bring every rank's records to rank 0.

Each rank records only its own transfers; the gather to rank 0 uses ``gather_object`` outside the
recorded region, so the profiler's own traffic never shows up in the profile. A dense comparison
run is a second ``Trainer`` on the groups the first one created (``init_groups=False``), with the
same config but ``filter.mode=off``, so both runs see the same data, layout and parameters.
"""

from __future__ import annotations

import platform
from dataclasses import asdict

import torch
import torch.distributed as dist

from megasparse.config import load_config, to_dict
from megasparse.parallel import comm, state

WARMUP_STEPS = 1
"""Steps left out of the summary when more than one is run: the first step pays one-off costs (allocator,
NCCL communicator set-up) that would distort timings. Volumes are static, so bytes do not depend on it."""


def record_steps(trainer, steps: int, time_on_gpu: bool = False) -> list[dict]:
    """``steps`` train steps under a recorder; this rank's records (with ``rank``), step-tagged."""
    rec = comm.CommRecorder(time_on_gpu=time_on_gpu)
    with comm.recording(rec):
        for i in range(steps):
            rec.step = i
            trainer.train_step()
    rank = dist.get_rank() if dist.is_initialized() else 0
    return [dict(r.as_dict(), rank=rank) for r in rec.records]


def gather_records(records: list[dict]) -> list[dict] | None:
    """All ranks' records on rank 0 (None on the others), ordered by rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(records)
    rank = dist.get_rank()
    parts: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(records, parts, dst=0)
    if rank != 0:
        return None
    return [r for part in parts for r in part]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def missing_reference(cfg) -> str | None:
    """Why excess scoring cannot run with this config (no reference source given), or None."""
    f = cfg.filter
    if f.mode == "off" or f.scorer != "excess":
        return None
    if f.reference == "sidecar" and not cfg.data.ref_losses:
        return "filter.reference=sidecar without data.ref_losses"
    if f.reference == "ngram" and not f.ngram_path:
        return "filter.reference=ngram without filter.ngram_path"
    return None


def profile(
    config: str | None,
    overrides: list[str],
    steps: int | None = None,
    compare_dense: bool | None = None,
    time_on_gpu: bool | None = None,
) -> dict | None:
    """Profile ``config`` (+ overrides); the comm.json document on rank 0, None on other ranks.

    ``steps`` defaults to min(3, train.steps); ``compare_dense`` defaults to filter.mode != off;
    ``time_on_gpu`` defaults to on when training on CUDA (it synchronises around each transfer).
    Process groups are created here and left alive: the caller destroys them.
    """
    from megasparse.train import Trainer

    # every transfer is recorded as Python issues it; a replayed CUDA graph issues its collectives without Python.
    # Eager also turns DP's overlapped bucket reduction back on (dp > 1): the bytes are the same, the timing is eager's.
    overrides = list(overrides) + ["train.cuda_graphs=false"]
    cfg = load_config(config, overrides)
    fallback = missing_reference(cfg)
    if fallback:
        # Volumes follow the static kept count; only SP padding depends on which tokens win (decision 0601).
        if state.world_env()[0] == 0:
            print(f"profile-comm: {fallback}: scoring by model loss (filter.scorer=loss) instead", flush=True)
        overrides.append("filter.scorer=loss")
        cfg = load_config(config, overrides)
    n = steps if steps is not None else min(3, cfg.train.steps)
    if n < 1:
        raise ValueError(f"--steps {n}: profile at least one step")
    mode = cfg.filter.mode
    compare = (mode != "off") if compare_dense is None else (compare_dense and mode != "off")
    trainer = Trainer(cfg)
    timed = trainer.device.type == "cuda" if time_on_gpu is None else time_on_gpu
    lay = trainer.lay
    meta = {
        "config_path": config,
        "overrides": overrides,
        "scorer_fallback": fallback,
        "config": to_dict(cfg),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "layout": asdict(lay),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": device_name(trainer.device),
        "dtype": str(trainer.compute_dtype).replace("torch.", ""),
        "filter_mode": mode,
        "keep_ratio": cfg.filter.keep_ratio if mode != "off" else 1.0,
        "granularity": cfg.filter.granularity,
        "microbatches_per_step": trainer.num_mb,
        "steps": n,
        "warmup_steps_excluded": WARMUP_STEPS if n > WARMUP_STEPS else 0,
        "time_on_gpu": timed,
        "primary": mode if mode != "off" else "dense",
        "anchor": "dense" if compare else None,
    }
    runs = {meta["primary"]: {"filter_mode": mode, "records": record_steps(trainer, n, timed)}}
    del trainer
    if compare:
        dense = Trainer(load_config(config, overrides + ["filter.mode=off"]), init_groups=False)
        runs["dense"] = {"filter_mode": "off", "records": record_steps(dense, n, timed)}
        del dense
    gathered = {label: gather_records(run["records"]) for label, run in runs.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    for label, recs in gathered.items():
        runs[label]["records"] = recs
    return {"meta": meta, "runs": runs}
