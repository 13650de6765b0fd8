"""``megasparse hf import`` and ``megasparse hf export``: whole-model conversions between an HF directory and a
megasparse checkpoint (the layout-independent DCP format of ``checkpoint.py``, decision 0902), one process.

An import writes a run directory (``config.yaml`` + ``checkpoints/step-0``) that ``megasparse train``,
``eval``, ``generate`` and ``hf export`` read like any run's. An export reads the global tensors of a checkpoint
saved at any layout a few at a time (DCP reassembles the pieces), applies 2:4 masks, and writes shards of at most
``shard_bytes``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from megasparse import checkpoint as ckpt
from megasparse.configbase import ConfigError
from megasparse.hf.convert import TOKENIZER_FILES, HFReader, check_shapes, read_hf_config, tokenizer_check
from megasparse.hf.names import HFError, global_names, hf_config, hf_parts, model_overrides
from megasparse.model.config import ModelConfig
from megasparse.parallel.shards import Placement

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _shape_record(m: ModelConfig, vocab: int) -> dict:
    """``layout.json``'s model shape, as ``checkpoint.model_shape`` records it for a built model."""
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.kv_heads, "ffn_hidden_size": m.ffn_size, "vocab_size": vocab,
    }  # fmt: skip


def _fresh_dir(out: Path, what: str) -> None:
    """Never write over an earlier import, export or run: ``out`` must be new or empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{what}: {out} already exists and is not empty; name a new directory (nothing was written)")


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir``/config.yaml and ``out_dir``/checkpoints/step-0 from an HF directory; returns out_dir."""
    from megasparse.config import Config, dump_config
    from megasparse.configbase import from_dict

    hf_dir, out = Path(hf_dir), Path(out_dir)
    _fresh_dir(out, "megasparse hf import")
    ov = model_overrides(read_hf_config(hf_dir), f"{hf_dir}/config.json")
    m = from_dict(ModelConfig, ov)
    m.validate()
    vocab = ov["vocab_size"]
    reader = HFReader(hf_dir)
    check_shapes(reader, m, vocab)
    tokenizer_check(hf_dir, vocab)
    tensors = {}
    for name in global_names(m):
        parts = [reader.files[reader.where[k]].get_tensor(k) for k in hf_parts(name, m.tie_embeddings)]
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        tensors["model." + name] = (t, Placement(tuple(t.shape), 0, ((0, 0, t.shape[0]),), replicated=True))
    root = out / "checkpoints"
    step = root / "step-0"
    root.mkdir(parents=True, exist_ok=True)
    dcp.save({k: t for k, (t, _) in tensors.items()}, checkpoint_id=str(step), planner=ckpt._SavePlanner(tensors),
             no_dist=True)  # fmt: skip
    record = {"format": ckpt.FORMAT, "tp": 1, "pp": 1, "dp": 1, "model": _shape_record(m, vocab)}
    (step / ckpt.LAYOUT).write_text(json.dumps(record))
    ckpt.write_checksums(step)
    (root / ckpt.ORDER).write_text("step-0\n")
    for f in TOKENIZER_FILES:
        if (hf_dir / f).is_file():
            shutil.copy(hf_dir / f, out / f)
    cfg = Config()
    cfg.model = m
    cfg.checkpoint.init_from = str(out.resolve())
    if (out / "tokenizer.json").is_file():
        cfg.data.tokenizer = str((out / "tokenizer.json").resolve())
    dump_config(cfg, out / "config.yaml")
    return out


def run_config_of(path: str | Path):
    """(config, checkpoint step directory) of a run's out_dir, an import's directory or one step-N directory."""
    from megasparse.config import load_config

    where = ckpt.resolve_resume(str(path))
    for cand in (Path(path) / "config.yaml", where.parent.parent / "config.yaml", where.parent / "config.yaml"):
        if cand.is_file():
            return load_config(cand), where
    raise ConfigError(f"{path}: no config.yaml next to checkpoint {where}; give the run's out_dir")


def _load_global(where: Path, keys: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Whole global tensors ``keys`` (shape, saved dtype) of a checkpoint, reassembled from any layout's pieces."""
    sd = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in keys.items()}
    dcp.load(sd, checkpoint_id=str(where), no_dist=True)
    return sd


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", shard_bytes: int = 4 << 30) -> Path:
    """Sharded safetensors + index + config.json (+ the run's tokenizer files) from a checkpoint of any layout."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    out = Path(out_dir)
    _fresh_dir(out, "megasparse hf export")
    cfg, where = run_config_of(ckpt_dir)
    ckpt.verify_checksums(where)
    m = cfg.model
    vocab = ckpt.read_layout(where)["model"]["vocab_size"]
    meta = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    dense = "extra.sparsity_dense" in meta and bool(_load_global(where, {"extra.sparsity_dense": ((), torch.int64)})[
        "extra.sparsity_dense"])  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    to = DTYPES[dtype]
    weight_map: dict[str, str] = {}
    shards: list[list[str]] = [[]]
    size = 0
    names = global_names(m)
    for name in names:  # plan shards by size (a tensor never splits)
        info = meta.get("model." + name)
        if info is None:
            raise HFError(f"checkpoint {where} has no tensor model.{name}; is it this model's checkpoint?")
        n = info.size.numel() * to.itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    for i, group in enumerate(shards):
        keys = {}
        for name in group:
            keys["model." + name] = (tuple(meta["model." + name].size), meta["model." + name].properties.dtype)
            mk = f"extra.mask.{name}"
            if mk in meta and not dense:  # 2:4: the weights the sparse run computed with
                keys[mk] = (tuple(meta[mk].size), meta[mk].properties.dtype)
        got = _load_global(where, keys)
        tensors: dict[str, torch.Tensor] = {}
        for name in group:
            t = got["model." + name]
            if f"extra.mask.{name}" in got:
                t = t * got[f"extra.mask.{name}"].to(t.dtype)
            parts = hf_parts(name, m.tie_embeddings)
            sizes = _part_rows(name, m, t.shape[0])
            for key, piece in zip(parts, t.split(sizes)):
                tensors[key] = piece.to(to).contiguous()
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    total = sum(meta["model." + n].size.numel() for n in names) * to.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = hf_config(m, vocab, "bfloat16" if dtype == "bf16" else "float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = Path(cfg.data.tokenizer) if cfg.data.tokenizer and not cfg.data.tokenizer.startswith("builtin:") else None
    if tok is not None and tok.is_file():
        shutil.copy(tok, out / "tokenizer.json")
        for f in TOKENIZER_FILES[1:]:
            if (tok.parent / f).is_file():
                shutil.copy(tok.parent / f, out / f)
    return out


def _part_rows(name: str, m: ModelConfig, rows: int) -> list[int]:
    """Row counts of the HF tensors that ``name`` concatenates."""
    d = m.head_dim
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv_bias"):
        return [m.num_attention_heads * d, m.kv_heads * d, m.kv_heads * d]
    if name.endswith("mlp.fc1.weight"):
        return [m.ffn_size, m.ffn_size]
    return [rows]
