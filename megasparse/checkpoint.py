"""Sharded checkpoints with torch.distributed.checkpoint, saved atomically.

Each rank contributes its own shards under keys that name its TP/PP coordinates; DP replicas write
the same keys and DCP stores them once. A save goes to ``<dir>/.tmp-step-N`` and is renamed to
``<dir>/step-N`` by rank 0 only after every rank finished, so an interrupted save never replaces the
last good checkpoint. Resuming requires the same tp/pp layout (DP may differ).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megasparse.configbase import ConfigError
from megasparse.parallel import state

_STEP = re.compile(r"^step-(\d+)$")


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
    found = [p for p in root.iterdir() if _STEP.match(p.name) and (p / ".metadata").exists()]
    return sorted(found, key=lambda p: int(_STEP.match(p.name).group(1)))


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


def save(root: str | os.PathLike, step: int, model, optimizer, extra: dict, keep_last: int = 2) -> Path:
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(model_state(model, optimizer, extra), checkpoint_id=str(tmp))
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in valid_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load(path: Path, model, optimizer, extra: dict) -> dict:
    """Load in place; returns ``extra`` with the saved values."""
    sd = model_state(model, optimizer, extra)
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - one clear line instead of a DCP traceback
        raise ConfigError(
            f"checkpoint {path} does not match this run ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "resume with the same model and parallel.tp/pp"
        ) from e
    return {k: sd[_key(f"extra.{k}")] for k in extra}


def load_weights(path: str | os.PathLike, model: torch.nn.Module, layout: state.Layout | None = None) -> None:
    """Load only the model parameters of a checkpoint (a reference model; same tp/pp layout).

    ``layout``: the model's own place (a whole-model reference on the last stage: pp=1); it is then read by this
    rank alone, since the other pipeline stages hold no reference and cannot join a collective load.
    """
    where = resolve_resume(str(path))
    sd = {_key("model." + name, layout): p.data for name, p in model.named_parameters()}
    try:
        dcp.load(sd, checkpoint_id=str(where), no_dist=layout is not None)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"checkpoint {where} does not match this model ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "it must come from the same model shape and parallel.tp/pp"
        ) from e
