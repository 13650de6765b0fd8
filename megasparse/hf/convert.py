"""Hugging Face safetensors in and out of megasparse: a rank's own slices read from memory-mapped shards
(``checkpoint.init_from``), ``megasparse hf import`` (an HF directory -> a megasparse checkpoint) and
``megasparse hf export`` (a checkpoint of any layout -> sharded safetensors loadable by ``from_pretrained``).

Slicing follows ``parallel/shards.py``: each local parameter is pieces of its layout-independent global tensor,
and a global tensor is a row concatenation of HF tensors (``names.hf_parts``), so a piece is read as row or
column slices of one or more HF tensors with ``safe_open(...).get_slice``; nothing else is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megasparse.hf.names import HFError, global_names, hf_parts, model_overrides

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and ((p / INDEX).is_file() or (p / SINGLE).is_file())


def read_hf_config(hf_dir: str | Path) -> dict:
    f = Path(hf_dir) / "config.json"
    if not f.is_file():
        raise HFError(f"{hf_dir} has no config.json; give a Hugging Face model directory")
    return json.loads(f.read_text())


def _header(path: Path) -> tuple[int, dict]:
    """(where a safetensors file's data starts, its JSON header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


class HFReader:
    """Memory-mapped access to a directory's safetensors shards: shapes from the headers, slices on demand."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        if (self.dir / INDEX).is_file():
            weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            weight_map = None
        else:
            raise HFError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self.files, self.where = {}, {}
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise HFError(f"{hf_dir}: shard {name} named by {INDEX} is missing")
            try:
                self.files[name] = safe_open(str(path), framework="pt")
                keys = list(self.files[name].keys())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise HFError(f"{hf_dir}: shard {name} is unreadable (truncated?): {str(e).splitlines()[0]}") from e
            size, header = path.stat().st_size, _header(path)
            for k in keys:
                end = header[0] + header[1][k]["data_offsets"][1]  # safetensors checks this only when reading
                if end > size:
                    raise HFError(f"{hf_dir}: shard {name} is truncated ({size} bytes, tensor {k} ends at {end})")
                self.where[k] = name
        if weight_map:
            lost = sorted(k for k, f in weight_map.items() if k not in self.where)
            if lost:
                raise HFError(f"{hf_dir}: tensor {lost[0]} is listed in {INDEX} but not in its shard")

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.where:
            raise HFError(f"{self.dir}: tensor {key} is missing")
        return tuple(self.files[self.where[key]].get_slice(key).get_shape())

    def rows(self, key: str, lo: int, hi: int, dim: int = 0, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """``key``[lo:hi] along ``dim`` (0 or 1; ``cols``: also columns for dim 0), read from the mmap."""
        sl = self.files[self.where[key]].get_slice(key)
        if dim == 1:
            return sl[:, lo:hi]
        if cols is not None:
            return sl[lo:hi, cols[0] : cols[1]]
        return sl[lo:hi]


def check_shapes(reader: HFReader, m, vocab: int) -> None:
    """Every HF tensor's shape against what config.json implies; one line naming the first that differs."""
    d, h, f = m.head_dim, m.hidden_size, m.ffn_size
    want = {
        "embedding.weight": [(vocab, h)],
        "output_weight": [(vocab, h)],
        "final_norm.weight": [(h,)],
    }
    per_layer = {
        "attn_norm.weight": [(h,)],
        "mlp_norm.weight": [(h,)],
        "attn.qkv.weight": [(m.num_attention_heads * d, h), (m.kv_heads * d, h), (m.kv_heads * d, h)],
        "attn.qkv_bias": [(m.num_attention_heads * d,), (m.kv_heads * d,), (m.kv_heads * d,)],
        "attn.proj.weight": [(h, m.num_attention_heads * d)],
        "mlp.fc1.weight": [(f, h), (f, h)],
        "mlp.fc2.weight": [(h, f)],
    }
    for name in global_names(m):
        shapes = want.get(name) or per_layer[name.split(".", 2)[2]]
        for key, shape in zip(hf_parts(name, m.tie_embeddings), shapes):
            got = reader.shape(key)
            if got != shape:
                raise HFError(f"{reader.dir}: tensor {key} has shape {list(got)}, config.json implies {list(shape)}")


def _piece(reader: HFReader, parts: list[str], dim: int, start: int, n: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + n) of the row concatenation of ``parts``."""
    if dim == 1:
        (key,) = parts
        return reader.rows(key, start, start + n, dim=1)
    out, base = [], 0
    for key in parts:
        rows = reader.shape(key)[0]
        lo, hi = max(start, base), min(start + n, base + rows)
        if hi > lo:
            out.append(reader.rows(key, lo - base, hi - base))
        base += rows
    return torch.cat(out) if len(out) > 1 else out[0]


def load_hf_into(hf_dir: str | Path, model: torch.nn.Module, model_cfg, vocab: int) -> None:
    """Copy this rank's slices of every parameter of ``model`` (a stage or a rank's chunks, any layout) from an HF
    directory whose config.json matches ``model_cfg``; the padding rows of the vocabulary stay zero."""
    from megasparse.parallel import state
    from megasparse.parallel.shards import placement

    check_config(hf_dir, model_cfg)
    reader = HFReader(hf_dir)
    check_shapes(reader, model_cfg, vocab)
    lay = state.layout()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = model.global_name(name)
            parts = hf_parts(gname, model_cfg.tie_embeddings)
            pl = placement(p, lay.tp, lay.tp_rank)
            for offsets, view in pl.chunks(p.data):
                view.copy_(_piece(reader, parts, pl.dim, offsets[pl.dim], view.shape[pl.dim]))


def init_from(path: str, model: torch.nn.Module, model_cfg, vocab: int, masked: bool = False) -> None:
    """``checkpoint.init_from``: this rank's weights from an HF directory or a megasparse checkpoint (any layout);
    the optimizer, step and data order start fresh. ``masked`` (eval, generate): a 2:4 checkpoint's weights are
    multiplied by their saved masks, the weights that run computed with (training recomputes masks instead)."""
    if is_hf_dir(path):
        tokenizer_check(Path(path), vocab)
        load_hf_into(path, model, model_cfg, vocab)
        return
    from megasparse import checkpoint as ckpt

    if not Path(path).exists():
        raise HFError(f"checkpoint.init_from={path}: no such directory")
    ckpt.load_weights(path, model)
    if masked:
        apply_saved_masks(ckpt.resolve_resume(path), model)


def apply_saved_masks(where: Path, model: torch.nn.Module) -> None:
    """W ⊙ M for every weight with a saved 2:4 mask (``extra.mask.<global name>``), unless the run had gone dense."""
    from torch.distributed.checkpoint import FileSystemReader

    from megasparse import checkpoint as ckpt
    from megasparse.parallel import state
    from megasparse.parallel.shards import shard_like

    meta = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    params = {model.global_name(n): p for n, p in model.named_parameters()}
    extra = {f"mask.{g}": shard_like(torch.zeros_like(p, dtype=torch.uint8), p) for g, p in params.items()
             if f"extra.mask.{g}" in meta}  # fmt: skip
    if not extra:
        return
    if "extra.sparsity_dense" in meta:
        extra["sparsity_dense"] = torch.zeros((), dtype=torch.int64)
    tensors, _ = ckpt._collect(torch.nn.Module(), None, extra, state.layout())
    ckpt._dcp_load(where, tensors, no_dist=True)
    if int(extra.get("sparsity_dense", 0)):
        return
    with torch.no_grad():
        for k, m in extra.items():
            if k.startswith("mask."):
                params[k[len("mask.") :]].mul_(m.to(params[k[len("mask.") :]].dtype))


def check_config(hf_dir: str | Path, model_cfg) -> None:
    """One line naming the first model key where the run's config differs from the HF directory's."""
    want = model_overrides(read_hf_config(hf_dir), f"{hf_dir}/config.json")
    for k, v in want.items():
        if k in ("seq_length", "init_std"):
            continue
        have = getattr(model_cfg, k)
        if k == "num_query_groups":
            have = model_cfg.kv_heads
        if have != v:
            raise HFError(
                f"checkpoint.init_from={hf_dir}: model.{k} is {v} there and {have} in this run; "
                f"start from `megasparse hf import`'s config.yaml or set model.{k}={v}"
            )


def tokenizer_check(hf_dir: Path, vocab: int) -> None:
    tok = hf_dir / "tokenizer.json"
    if not tok.is_file():
        return
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(tok)).get_vocab_size()
    if n > vocab:
        raise HFError(f"{tok}: the tokenizer has {n} tokens, more than the embedding's {vocab} rows")
