"""Sharded checkpoints with torch.distributed.checkpoint, saved atomically.

Each rank contributes its own shards under keys that name its TP/PP coordinates; DP replicas write
the same keys and DCP stores them once. A save goes to ``<dir>/.tmp-step-N`` and is renamed to
``<dir>/step-N`` by rank 0 only after every rank finished, so an interrupted save never replaces the
last good checkpoint. Resuming requires the same tp/pp layout (DP may differ).

Reliability (docs/reliability.md): every file's CRC32 goes into ``checksums.json`` at save and is verified
before a load; a state with non-finite values is never saved; ``order.txt`` records the run's write order,
which pruning and ``resume=auto`` follow; resuming from an older step moves the newer checkpoints aside
(``abandoned-step-N``) so neither pruning nor a later automatic resume can pick the abandoned branch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megasparse.configbase import ConfigError
from megasparse.parallel import comm, state

_STEP = re.compile(r"^step-(\d+)$")
CHECKSUMS = "checksums.json"
ORDER = "order.txt"

try:  # DCP's CheckpointException derives from BaseException, so `except Exception` misses it
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - older torch
    CheckpointException = Exception

_LOAD_ERRORS = (Exception, CheckpointException)


def _one_line(e: BaseException) -> str:
    """The first meaningful line of an exception (DCP wraps per-rank failures in a dict of tracebacks)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        if isinstance(inner, tuple):  # CheckpointException keeps (exception, stack summary) pairs
            inner = inner[0]
        return f"rank {rank}: {_one_line(inner)}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:240] if lines else ''}"


def _crc32(path: Path, chunk: int = 1 << 24) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_checksums(ckpt_dir: Path) -> None:
    """CRC32 of every file of a finished save (rank 0, before the rename makes it visible)."""
    sums = {p.name: _crc32(p) for p in sorted(ckpt_dir.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    (ckpt_dir / CHECKSUMS).write_text(json.dumps(sums, indent=0))


def verify_checksums(ckpt_dir: Path) -> None:
    """One-line ConfigError naming the first missing or corrupted file; silent for pre-checksum saves."""
    f = ckpt_dir / CHECKSUMS
    if not f.exists():
        return
    for name, want in json.loads(f.read_text()).items():
        p = ckpt_dir / name
        if not p.exists():
            raise ConfigError(f"checkpoint {ckpt_dir} is incomplete: file {name} is missing")
        got = _crc32(p)
        if got != want:
            raise ConfigError(
                f"checkpoint {ckpt_dir} is corrupted: {name} has CRC32 {got}, saved as {want}; "
                "resume from an earlier step-N"
            )


def all_finite(sd: dict) -> bool:
    """True on every rank when no rank holds a NaN/inf in any floating tensor of ``sd``."""
    dev = next((v.device for v in sd.values() if torch.is_tensor(v) and v.is_floating_point()), torch.device("cpu"))
    bad = torch.zeros((), dtype=torch.float32, device=dev)  # on the backend's device (NCCL needs CUDA)
    for v in sd.values():
        if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad += 1
            break
    if dist.is_initialized():
        with comm.phase("checkpoint"):
            comm.all_reduce(bad, None, "world", region="checkpoint.finite")
    return bool(bad.item() == 0)


def _key(name: str, lay: state.Layout | None = None) -> str:
    lay = lay or state.layout()
    return f"tp{lay.tp_rank}.pp{lay.pp_rank}.{name}"


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> dict:
    sd: dict = {}
    for name, p in model.named_parameters():
        sd[_key("model." + name)] = p.data
        st = optimizer.state.get(p)
        if st is None:  # materialise empty Adam state so a load has somewhere to write
            st = optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p.data),
                "exp_avg_sq": torch.zeros_like(p.data),
            }
        for k, v in st.items():
            sd[_key(f"optim.{name}.{k}")] = v
    for k, v in extra.items():
        sd[_key(f"extra.{k}")] = v
    return sd


def valid_checkpoints(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = {p.name: p for p in root.iterdir() if _STEP.match(p.name) and (p / ".metadata").exists()}
    order = (root / ORDER).read_text().split() if (root / ORDER).exists() else []
    rank = {name: i for i, name in enumerate(order)}  # last write wins when a step was written twice
    # Oldest first, by this run's write order; saves older than order.txt (not listed) first, by step.
    return sorted(found.values(), key=lambda p: (p.name in rank, rank.get(p.name, int(_STEP.match(p.name)[1]))))


def resume_target(resume: str | None, out_dir: str | os.PathLike, log=print) -> str | None:
    """``checkpoint.resume`` as a path: ``auto`` is the latest valid checkpoint of ``out_dir``, or None (fresh
    start, said in one line) so one command serves the first launch and every torchrun restart."""
    if resume != "auto":
        return resume
    found = valid_checkpoints(Path(out_dir) / "checkpoints")
    if not found:
        log(f"checkpoint.resume=auto: no checkpoint in {Path(out_dir) / 'checkpoints'}; starting from step 0")
        return None
    return str(found[-1])


def set_aside_newer(where: Path) -> list[tuple[str, Path]]:
    """Rank 0, after resuming from ``where``: rename checkpoints written after it to ``abandoned-step-N``."""
    root = where.parent
    found = valid_checkpoints(root)
    names = [p.name for p in found]
    if where.name not in names:
        return []
    newer = found[names.index(where.name) + 1 :]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for p in newer:
        dst = root / f"abandoned-{stamp}-{p.name}"
        os.replace(p, dst)
        moved.append((p.name, dst))
    if moved:
        kept = names[: names.index(where.name) + 1]
        (root / ORDER).write_text("\n".join(kept) + "\n")
    return moved


def resolve_resume(path: str) -> Path:
    """A step-N directory, or the newest valid one under a run's checkpoints/ folder."""
    p = Path(path)
    if _STEP.match(p.name) and (p / ".metadata").exists():
        return p
    for root in (p / "checkpoints", p):
        found = valid_checkpoints(root)
        if found:
            return found[-1]
    raise ConfigError(
        f"checkpoint.resume={path!r} holds no valid checkpoint (no step-N directory with a .metadata file); "
        "point it at a run's out_dir or a step-N directory"
    )


def save(root: str | os.PathLike, step: int, model, optimizer, extra: dict, keep_last: int = 2) -> Path | None:
    """Atomic sharded save; None (nothing written) when any rank's state holds a non-finite value."""
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    sd = model_state(model, optimizer, extra)
    if not all_finite(sd):  # never write, or rotate in, a checkpoint that would resume into NaN
        return None
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(sd, checkpoint_id=str(tmp))
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        write_checksums(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        order = [n for n in ((root / ORDER).read_text().split() if (root / ORDER).exists() else []) if n != final.name]
        (root / ORDER).write_text("\n".join([*order, final.name]) + "\n")
        for old in valid_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load(path: Path, model, optimizer, extra: dict) -> dict:
    """Load in place (checksums first); returns ``extra`` with the saved values. Checkpoints this run wrote
    after ``path`` are then moved aside (see set_aside_newer)."""
    path = Path(path)
    verify_checksums(path)
    sd = model_state(model, optimizer, extra)
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except _LOAD_ERRORS as e:  # noqa: BLE001 - one clear line instead of a DCP traceback
        raise ConfigError(
            f"checkpoint {path} does not match this run ({_one_line(e)}); resume with the same model and parallel.tp/pp"
        ) from e
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        for name, dst in set_aside_newer(path):
            print(f"checkpoint: resuming from {path.name}; moved the later-written {name} aside to {dst}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return {k: sd[_key(f"extra.{k}")] for k in extra}


def load_weights(path: str | os.PathLike, model: torch.nn.Module, layout: state.Layout | None = None) -> None:
    """Load only the model parameters of a checkpoint (a reference model; same tp/pp layout).

    ``layout``: the model's own place (a whole-model reference on the last stage: pp=1); it is then read by this
    rank alone, since the other pipeline stages hold no reference and cannot join a collective load.
    """
    where = resolve_resume(str(path))
    verify_checksums(where)
    sd = {_key("model." + name, layout): p.data for name, p in model.named_parameters()}
    try:
        dcp.load(sd, checkpoint_id=str(where), no_dist=layout is not None)
    except _LOAD_ERRORS as e:  # noqa: BLE001
        raise ConfigError(
            f"checkpoint {where} does not match this model ({_one_line(e)}); "
            "it must come from the same model shape and parallel.tp/pp"
        ) from e
