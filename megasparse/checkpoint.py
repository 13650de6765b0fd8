"""Sharded checkpoints with torch.distributed.checkpoint that resume at any tp × pp × dp layout, saved atomically.

Keys and offsets are layout-independent (docs/decisions/0902): every tensor is saved under a global key
(``model.<global name>``, ``optim.<global name>.<state>``, ``extra.<name>``; global layer ids) as its pieces of the
logical global tensor at global offsets (``parallel/shards.py``). A load asks DCP for exactly this rank's pieces at
its own layout and DCP reads the saved pieces that overlap them. DP replicas are identical, so only DP rank 0
writes, and TP-replicated tensors only TP rank 0. ``layout.json`` records the writer's layout and the model shape,
checked before a load: a different model is one line naming the dimension.

A save goes to ``<dir>/.tmp-step-N`` and is renamed to ``<dir>/step-N`` by rank 0 only after every rank finished, so
an interrupted save never replaces the last good checkpoint. Reliability (docs/reliability.md): every file's CRC32
goes into ``checksums.json`` at save and is verified before a load; a state with non-finite values is never saved;
``order.txt`` records the run's write order, which pruning and ``resume=auto`` follow; resuming from an older step
moves the newer checkpoints aside (``abandoned-step-N``) so neither pruning nor a later automatic resume can pick
the abandoned branch.
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
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megasparse.configbase import ConfigError
from megasparse.parallel import comm, state
from megasparse.parallel.shards import global_name, placement
from megasparse.rundir import StorageError, storage_error

_STEP = re.compile(r"^step-(\d+)$")
CHECKSUMS = "checksums.json"
ORDER = "order.txt"
LAYOUT = "layout.json"
FORMAT = 2
"""layout.json's format: 2 = global keys and global-offset pieces (docs/decisions/0902)."""

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


_verified: set[tuple] = set()  # checkpoints this process verified, with every file's (name, size, mtime)


def verify_checksums(ckpt_dir: Path) -> None:
    """One-line ConfigError naming the first missing or corrupted file; silent for pre-checksum saves."""
    f = ckpt_dir / CHECKSUMS
    if not f.exists():
        return
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt_dir.iterdir() if p.is_file())
    key = (str(Path(ckpt_dir).resolve()), tuple(files))
    if key in _verified:  # resume=auto verified it a moment ago: one CRC pass per resume, not two
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
    _verified.add(key)


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


def model_shape(model: torch.nn.Module) -> dict[str, int]:
    """The shape a checkpoint must share with the model that loads it (any layout); {} for a bare module."""
    m = getattr(model, "cfg", None)
    if m is None:
        return {}
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.kv_heads,
        "ffn_hidden_size": m.ffn_size,
        "vocab_size": model.vocab_size,
    }


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, dict]]:
    """``optimizer.state_dict()`` with every parameter's state materialised, and that state by local parameter name.

    The one place checkpoints read optimizer state, and ``optimizer.load_state_dict`` (in ``load``) the one place
    they write it: an optimizer whose ``state_dict()`` gathers its shards into plain AdamW's layout (a distributed
    optimizer) plugs in here. Parameters are numbered in ``param_groups`` order, torch's own convention. A parameter
    without state gets zeros at step 0, which is what AdamW's first step starts from.
    """
    osd = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    by_name: dict[str, dict] = {}
    for name, p in model.named_parameters():
        st = osd["state"].get(index[id(p)])
        if not st:
            st = osd["state"][index[id(p)]] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p.data),
                "exp_avg_sq": torch.zeros_like(p.data),
            }
        by_name[name] = st
    return osd, by_name


def _collect(model, optimizer, extra: dict, lay: state.Layout) -> tuple[dict[str, tuple], dict | None]:
    """Every tensor of a checkpoint by global key, with its placement at this rank's layout; and the optimizer's
    state dict those tensors belong to (None without an optimizer)."""
    where = lambda t: placement(t, lay.tp, lay.tp_rank)  # noqa: E731
    out: dict[str, tuple] = {}
    for name, p in model.named_parameters():
        out["model." + global_name(model, name)] = (p.data, where(p))
    osd = None
    if optimizer is not None:
        osd, by_name = optimizer_state(model, optimizer)
        for name, st in by_name.items():
            p = model.get_parameter(name)
            for k, v in st.items():  # moments shard like their parameter; the step count is replicated
                like = p if v.shape == p.shape else v
                out[f"optim.{global_name(model, name)}.{k}"] = (v, where(like))
    for k, v in extra.items():  # scalars are replicated; a 2:4 mask carries its weight's sharding (shard_like)
        out["extra." + k] = (v, where(v))
    return out, osd


class _SavePlanner(DefaultSavePlanner):
    """Writes each tensor as its pieces of the global tensor, at their global offsets, under its global key."""

    def __init__(self, tensors: dict[str, tuple]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(k, o): v for k, (t, pl) in tensors.items() for o, v in pl.chunks(t)}
        self._items = [
            WriteItem(
                index=MetadataIndex(k, torch.Size(o)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(o), v.shape),
                    properties=TensorProperties.create_from_tensor(v),
                    size=torch.Size(tensors[k][1].shape),
                ),
            )
            for (k, o), v in self._pieces.items()
        ]

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items))
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(index.fqn, tuple(index.offset))]


class _LoadPlanner(DefaultLoadPlanner):
    """Asks for exactly this rank's pieces at its own layout; DCP reads the saved pieces that overlap them."""

    def __init__(self, tensors: dict[str, tuple]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors = tensors
        self._pieces = {(k, o): v for k, (t, pl) in tensors.items() for o, v in pl.chunks(t)}

    def create_local_plan(self) -> LoadPlan:
        saved_md = self.metadata.state_dict_metadata
        items = []
        for key, (t, pl) in self._tensors.items():
            saved = saved_md.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key}")
            if tuple(saved.size) != pl.shape:
                raise ValueError(f"size mismatch for {key}: saved {list(saved.size)}, this run {list(pl.shape)}")
            chunks = [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in pl.chunks(t)]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(index.fqn, tuple(index.offset))]


def read_layout(ckpt_dir: Path) -> dict:
    """The writer's layout and model shape (``layout.json``); one line for a checkpoint older than this format."""
    f = ckpt_dir / LAYOUT
    if not f.exists():
        raise ConfigError(
            f"checkpoint {ckpt_dir} has no {LAYOUT}: it was written before checkpoints became layout-independent "
            "and this version cannot load it; resume it with the megasparse version that wrote it"
        )
    return json.loads(f.read_text())


def check_model(ckpt_dir: Path, saved: dict, model: torch.nn.Module) -> None:
    """One line naming the first model dimension that differs (the layout may differ; the model may not)."""
    there = saved.get("model", {})
    for k, v in model_shape(model).items():
        if k in there and there[k] != v:
            raise ConfigError(
                f"checkpoint {ckpt_dir} does not match this run: model.{k} is {there[k]} there and {v} here; "
                "resume with the same model shape (any parallel.tp/pp/dp)"
            )


def _dcp_load(where: Path, tensors: dict[str, tuple], no_dist: bool = False) -> None:
    try:
        dcp.load({k: t for k, (t, _) in tensors.items()}, checkpoint_id=str(where), planner=_LoadPlanner(tensors),
                 no_dist=no_dist)  # fmt: skip
    except _LOAD_ERRORS as e:  # noqa: BLE001 - one clear line instead of a DCP traceback
        raise ConfigError(
            f"checkpoint {where} does not match this run ({_one_line(e)}); resume with the same model shape and "
            "sparsity.enabled/layers (any parallel.tp/pp/dp)"
        ) from e


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
    start, said in one line) so one command serves the first launch and every torchrun restart. A checkpoint that
    fails its checksums (corrupted, a file missing) is skipped with one line and the next newest is taken."""
    if resume != "auto":
        return resume
    found = valid_checkpoints(Path(out_dir) / "checkpoints")
    for p in reversed(found):
        try:
            verify_checksums(p)
        except ConfigError as e:
            log(f"checkpoint.resume=auto: skipping {p.name}: {e}")
            continue
        return str(p)
    none = "no valid checkpoint" if found else "no checkpoint"
    log(f"checkpoint.resume=auto: {none} in {Path(out_dir) / 'checkpoints'}; starting from step 0")
    return None


def saved_step(where: Path) -> int:
    """The step of a ``step-N`` directory."""
    m = _STEP.match(Path(where).name)
    return int(m[1]) if m else -1


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


def _all_ok(ok: bool) -> bool:
    """True on every rank when every rank's ``ok`` is true."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    t = torch.tensor([0.0 if ok else 1.0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    with comm.phase("checkpoint"):
        comm.all_reduce(t, None, "world", op=dist.ReduceOp.MAX, region="checkpoint.ok")
    return bool(t.item() == 0)


def save(
    root: str | os.PathLike, step: int, model, optimizer, extra: dict, keep_last: int = 2, run: dict | None = None
) -> Path | None:
    """Atomic sharded save; None (nothing written) when any rank's state holds a non-finite value. ``run``: the
    settings a resume compares (runguard.run_record), kept in layout.json. A write that fails (disk full, EFBIG,
    read-only) removes the partial ``.tmp-step-N`` and raises one StorageError line on every rank."""
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    lay = state.layout()
    tensors, _ = _collect(model, optimizer, extra, lay)
    if not all_finite({k: t for k, (t, _) in tensors.items()}):  # never write, or rotate in, a NaN checkpoint
        return None
    err: BaseException | None = None
    if rank0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            err = e
    if dist.is_initialized():
        dist.barrier()
    # DP replicas are identical: only DP rank 0 writes; TP-replicated tensors (norms, scalars) only TP rank 0
    mine = {} if lay.dp_rank else {k: v for k, v in tensors.items() if lay.tp_rank == 0 or not v[1].replicated}
    if _all_ok(err is None):
        try:
            dcp.save({k: t for k, (t, _) in mine.items()}, checkpoint_id=str(tmp), planner=_SavePlanner(mine))
        except _LOAD_ERRORS as e:  # noqa: BLE001 - DCP raises on every rank when any rank's write failed
            err = e
    if dist.is_initialized():
        dist.barrier()
    if rank0 and err is None:
        try:
            record = {"format": FORMAT, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "model": model_shape(model)}
            if run is not None:
                record["run"] = run
            (tmp / LAYOUT).write_text(json.dumps(record))
            write_checksums(tmp)
        except OSError as e:
            err = e
    if not _all_ok(err is None):  # nothing renamed: the previous checkpoint is untouched
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise (
            storage_error(root, tmp, err, _one_line(err))
            if err is not None
            else StorageError(f"cannot write the checkpoint {tmp}: another rank's write failed (rank 0 names it)")
        )
    if rank0:
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
    """Load in place at this run's layout, whatever layout wrote it (checksums and model shape first); returns
    ``extra`` with the saved values. Checkpoints this run wrote after ``path`` are then moved aside
    (see set_aside_newer)."""
    path = Path(path)
    verify_checksums(path)
    saved = read_layout(path)
    check_model(path, saved, model)
    lay = state.layout()
    tensors, osd = _collect(model, optimizer, extra, lay)
    _dcp_load(path, tensors)
    optimizer.load_state_dict(osd)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        was, now = (saved["tp"], saved["pp"], saved["dp"]), (lay.tp, lay.pp, lay.dp)
        if was != now:
            print(f"checkpoint: {path.name} was saved at tp {was[0]} x pp {was[1]} x dp {was[2]}; "
                  f"resharded to tp {now[0]} x pp {now[1]} x dp {now[2]}", flush=True)  # fmt: skip
        for name, dst in set_aside_newer(path):
            print(f"checkpoint: resuming from {path.name}; moved the later-written {name} aside to {dst}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return {k: tensors["extra." + k][0] for k in extra}


def load_weights(path: str | os.PathLike, model: torch.nn.Module, layout: state.Layout | None = None) -> None:
    """Load only the model parameters of a checkpoint (a reference model, inference), at any layout.

    ``layout``: the model's own place (a whole-model reference on the last stage: pp=1); it is then read by this
    rank alone, since the other pipeline stages hold no reference and cannot join a collective load.
    """
    where = resolve_resume(str(path))
    verify_checksums(where)
    check_model(where, read_layout(where), model)
    lay = layout or state.layout()
    tensors, _ = _collect(model, None, {}, lay)
    _dcp_load(where, tensors, no_dist=layout is not None)
