"""Per-token reference-loss sidecar aligned with an indexed dataset (``prefix.bin`` / ``prefix.idx``).

Reference losses are computed once, offline (``megasparse ref ngram --sidecar-for`` / ``megasparse ref score``),
and read during training by global token offset, so the reference costs nothing per step.

File layout (little-endian), a 64-byte header then one value per token of ``prefix.bin``::

    b"MSREFLSS"  u32 version=1  u32 dtype code (1 float16, 2 float32)  u64 token count
    32 bytes dataset fingerprint  8 bytes reserved (zero)  dtype[token count] losses

Value ``i`` is the reference loss (nats) of predicting token ``i`` of ``.bin`` from its prefix, i.e. what the
trainer needs at the label position whose label is token ``i``. For the first token of a document the n-gram
source stores its loss at the start of a document (context = begin-of-document); ``ref score`` stores the model's
loss with whatever precedes it in the scoring window, and 0 for token 0 of the dataset, which has no prefix.

The fingerprint is sha256 over the ``.idx`` bytes followed by the ``.bin`` size (u64): any rebuild that changes
document boundaries, token dtype or token count changes it, without reading the whole ``.bin``.

A blend (``data.blend``) has one sidecar per dataset; :func:`open_sidecars` chains them in blend order, which is
how ``BlendedDataset`` numbers token positions (dataset ``k``'s ``.bin`` after the earlier ones').
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from megasparse.configbase import ConfigError
from megasparse.data.indexed import IndexedDataset

__all__ = [
    "ChainedSidecars",
    "SidecarError",
    "fingerprint",
    "gather_ref_losses",
    "open_sidecar",
    "open_sidecars",
    "write_sidecar",
]

MAGIC = b"MSREFLSS"
VERSION = 1
HEADER_BYTES = 64
_DTYPES = {1: np.dtype(np.float16), 2: np.dtype(np.float32)}
_CODE_OF = {v: k for k, v in _DTYPES.items()}
_HEADER = struct.Struct("<8sIIQ32s8x")
_FIX = "re-run `megasparse ref ngram --sidecar-for` or `megasparse ref score` for this dataset"


class SidecarError(ConfigError):
    """A sidecar that does not belong to the dataset it is used with; one line naming file, mismatch and fix."""


def fingerprint(prefix: str | os.PathLike) -> bytes:
    """sha256 of ``prefix.idx`` bytes + ``prefix.bin`` size: identifies one build of an indexed dataset."""
    ds = IndexedDataset(prefix)
    h = hashlib.sha256()
    with open(ds.idx_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(struct.pack("<Q", ds.bin_path.stat().st_size))
    return h.digest()


def _chunks(losses: np.ndarray | torch.Tensor | Iterable) -> Iterable[np.ndarray]:
    if isinstance(losses, (np.ndarray, torch.Tensor)):
        losses = [losses]
    for c in losses:
        if isinstance(c, torch.Tensor):
            c = c.detach().cpu().numpy()
        yield np.asarray(c).reshape(-1)


def write_sidecar(
    path: str | os.PathLike,
    prefix: str | os.PathLike,
    losses: np.ndarray | torch.Tensor | Iterable,
    dtype: str = "float16",
) -> Path:
    """Write the losses of every token of ``prefix`` (an array, or an iterable of chunks in token order).

    float16 halves the file (the same size as a uint16 ``.bin``); selection only compares losses, and fp16 keeps
    about three significant digits. Values are clipped to the dtype's finite range. Written atomically.
    """
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ConfigError(f"sidecar dtype {dtype!r}: use float16 or float32")
    ds = IndexedDataset(prefix)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    hi = float(np.finfo(dt).max)
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[dt], ds.num_tokens, fingerprint(prefix)))
            for c in _chunks(losses):
                written += c.size
                if written > ds.num_tokens:
                    continue  # keep counting for the error below
                f.write(np.clip(c.astype(np.float64), -hi, hi).astype(dt).tobytes())
        if written != ds.num_tokens:
            raise SidecarError(
                f"{path}: got {written} losses for dataset {ds.prefix} with {ds.num_tokens} tokens; "
                "the loss source must cover every token of .bin"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def open_sidecar(path: str | os.PathLike, prefix: str | os.PathLike) -> np.memmap:
    """Read-only mmap of the losses, after checking that the sidecar was made for this build of ``prefix``."""
    path = Path(path)
    if not path.is_file():
        raise SidecarError(f"reference-loss sidecar {path} does not exist; {_FIX}")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise SidecarError(f"{path} is not a megasparse reference-loss sidecar (bad header); {_FIX}")
    _, version, code, count, fp = _HEADER.unpack(head)
    if version != VERSION or code not in _DTYPES:
        raise SidecarError(f"{path}: sidecar version {version} / dtype code {code} not supported; {_FIX}")
    dt = _DTYPES[code]
    size = path.stat().st_size
    if size != HEADER_BYTES + count * dt.itemsize:
        raise SidecarError(
            f"{path}: {size} bytes but the header promises {count} {dt} losses; the file is truncated, {_FIX}"
        )
    ds = IndexedDataset(prefix)
    if count != ds.num_tokens:
        raise SidecarError(
            f"{path}: sidecar has {count} token losses but dataset {ds.prefix} has {ds.num_tokens} tokens; {_FIX}"
        )
    expected = fingerprint(prefix)
    if fp != expected:
        raise SidecarError(
            f"{path}: dataset fingerprint {fp.hex()[:16]}… does not match {ds.prefix} ({expected.hex()[:16]}…), "
            f"the dataset was rebuilt; {_FIX}"
        )
    if count == 0:
        return np.zeros(0, dtype=dt)
    return np.memmap(path, mode="r", dtype=dt, offset=HEADER_BYTES, shape=(count,))


class ChainedSidecars:
    """Several sidecars read as one: position ``offsets[k] + i`` is token ``i`` of dataset ``k``."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, pos: np.ndarray) -> np.ndarray:
        pos = np.asarray(pos, dtype=np.int64)
        out = np.empty(pos.shape, dtype=np.float32)
        which = np.searchsorted(self.offsets, pos, side="right") - 1
        for k in np.unique(which):
            at = which == k
            out[at] = self.parts[k][pos[at] - self.offsets[k]]
        return out


def open_sidecars(paths: list[str], prefixes: list[str]) -> ChainedSidecars:
    """One checked sidecar per dataset of a blend (``paths[k]`` for ``prefixes[k]``), chained in that order."""
    if len(paths) != len(prefixes):
        raise SidecarError(
            f"data.ref_losses has {len(paths)} sidecars for {len(prefixes)} blended datasets; give one per "
            "data.blend entry, in blend order"
        )
    return ChainedSidecars([open_sidecar(p, prefix) for p, prefix in zip(paths, prefixes)])


def gather_ref_losses(
    sidecar: np.ndarray | ChainedSidecars, token_offsets: torch.Tensor, fill: float = 0.0
) -> torch.Tensor:
    """float32 reference losses at global ``.bin`` token offsets (any shape, on the offsets' device).

    For LM training pass the offsets of the *labels*: with ``PackedDataset.positions(i)`` (the sample's
    ``seq_length + 1`` token positions) that is ``positions[1:]``. Offset -1 marks a token that is not in the
    ``.bin`` (an EOD the packer inserted) and gets ``fill``.
    """
    off = token_offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    if off.size and (off.min() < -1 or off.max() >= len(sidecar)):
        raise IndexError(f"token offsets [{off.min()}, {off.max()}] outside the sidecar's {len(sidecar)} tokens")
    flat = off.reshape(-1)
    vals = np.full(flat.shape, fill, dtype=np.float32)
    real = flat >= 0
    vals[real] = sidecar[flat[real]]
    if not np.isfinite(vals).all():  # NaN would make the selection keep the first k positions, silently
        bad = flat[~np.isfinite(vals)][:3].tolist()
        name = getattr(sidecar, "filename", None) or "data.ref_losses"
        raise SidecarError(f"{name}: non-finite reference losses (NaN/inf) at .bin token offsets {bad}; {_FIX}")
    return torch.from_numpy(vals.reshape(off.shape)).to(token_offsets.device)
