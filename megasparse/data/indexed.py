"""Megatron indexed datasets (``prefix.bin`` + ``prefix.idx``): a writer and an mmap reader.

The byte layout is megatron-core's ``MMapIndexedDataset`` (``megatron.core.datasets.indexed_dataset``), so
datasets written here feed megatron's own tools and the other way round (tests/test_data.py checks both
directions). megasparse keeps its own small reader because megatron's checks are ``assert`` statements that
give no fix and do not notice a truncated ``.bin``; here every problem is one ``DataError`` line naming
the file.

``.idx`` layout, little-endian::

    b"MMIDIDX\\x00\\x00"  u64 version=1  u8 dtype code  u64 sequence count N  u64 document count D
    i32[N] sequence lengths (tokens)  i64[N] byte pointers into .bin  i64[D] document indices
    [i8[N] sequence modes, multimodal datasets only]

``document_indices`` starts with 0 and lists, for each document, the sequence index one past its end, so
``D = documents + 1``. ``.bin`` is the plain concatenation of all sequences' token ids.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from megasparse.configbase import ConfigError

__all__ = ["DataError", "IndexedDataset", "IndexedWriter", "optimal_dtype", "write_indexed"]

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34

# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DataError(ConfigError):
    """A dataset that cannot be used as configured; the message is one line naming the file and the fix."""


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """Token dtype megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    p = str(prefix)
    for ext in (".bin", ".idx"):
        if p.endswith(ext):
            p = p[: -len(ext)]
    return Path(p + ".bin"), Path(p + ".idx")


class IndexedWriter:
    """Streams documents into ``prefix.bin`` and writes ``prefix.idx`` on close.

    Both files are written under temporary names and renamed at the end, so a crash or a concurrent reader
    never sees a half-written dataset. One sequence per document unless ``add_document`` is given lengths.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.number] | np.dtype = np.uint16) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise DataError(f"token dtype {self.dtype} has no megatron code; use one of uint16, int32, int64")
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + f".tmp{os.getpid()}")
        self._fh = open(self._tmp_bin, "wb")
        self.lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, token_ids: np.ndarray | list[int], lengths: list[int] | None = None) -> None:
        """Append one document; ``lengths`` splits it into sequences (megatron's sentences), default one.

        ``lengths=[]`` with no tokens is a document of no sequences, which is how megatron's
        ``preprocess_data.py`` stores a document that tokenizes to nothing."""
        arr = np.asarray(token_ids)
        lens = [int(arr.size)] if lengths is None else [int(n) for n in lengths]
        if sum(lens) != arr.size or any(n < 0 for n in lens):
            raise DataError(f"{self.bin_path}: sequence lengths {lens} do not add up to the {arr.size} tokens")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise DataError(f"{self.bin_path}: token ids [{arr.min()}, {arr.max()}] do not fit dtype {self.dtype}")
        self._fh.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.lengths.extend(lens)
        self.document_indices.append(len(self.lengths))
        self.num_tokens += int(arr.size)

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        tmp_idx = self.idx_path.with_name(self.idx_path.name + f".tmp{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)

    def abort(self) -> None:
        self._fh.close()
        self._tmp_bin.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_indexed(prefix: str | os.PathLike, documents, dtype: type[np.number] = np.uint16) -> None:
    """Write an iterable of token-id sequences as one indexed dataset (a document each)."""
    with IndexedWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)


class IndexedDataset:
    """Read-only mmap view of ``prefix.bin``/``prefix.idx``; items are whole documents as numpy arrays.

    Opening checks the header, version, dtype code, that the index's arrays fit the ``.idx`` file and that
    the ``.bin`` holds exactly the tokens the index points at; ``check_vocab`` checks token ids on demand.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.bin_path, self.idx_path = _paths(prefix)
        self.prefix = str(self.bin_path)[: -len(".bin")]
        for path, what in ((self.idx_path, "index"), (self.bin_path, "token")):
            if not path.is_file():
                raise DataError(
                    f"{what} file {path} does not exist; data.prefix={self.prefix!r} needs both .bin and .idx "
                    "(build them with `megasparse preprocess`)"
                )
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise DataError(f"{self.idx_path} is not a Megatron MMIDIDX index (bad header); rebuild it")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
        if version != INDEX_VERSION:
            raise DataError(f"{self.idx_path}: index version {version} is not supported (expected 1); rebuild it")
        if code not in DTYPE_CODES:
            raise DataError(f"{self.idx_path}: unknown token dtype code {code}; the index is corrupt, rebuild it")
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = _HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        if idx_size not in (need, need + n_seq):  # + optional i8 sequence modes
            raise DataError(
                f"{self.idx_path}: {idx_size} bytes but the header promises {need} "
                f"({n_seq} sequences, {n_doc} document indices); the index is corrupt, rebuild it"
            )
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off)
        self._check_consistency()
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = self.bin_path.stat().st_size
        if bin_size != n_tokens * self.dtype.itemsize:
            raise DataError(
                f"{self.bin_path}: {bin_size} bytes but {self.idx_path.name} indexes {n_tokens} {self.dtype} tokens "
                f"({n_tokens * self.dtype.itemsize} bytes); the .bin is truncated or from another build, rebuild it"
            )
        self.num_tokens = n_tokens
        self.tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype) if n_tokens else np.zeros(0, self.dtype)
        # document d covers tokens [doc_starts[d], doc_starts[d] + doc_lengths[d]) of .bin
        seq_cum = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=seq_cum[1:])
        di = self.document_indices
        self.doc_starts = seq_cum[di[:-1]] if n_doc else np.zeros(0, np.int64)
        self.doc_lengths = (seq_cum[di[1:]] - seq_cum[di[:-1]]) if n_doc else np.zeros(0, np.int64)

    def _check_consistency(self) -> None:
        lengths, pointers, di = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n = len(lengths)
        bad = ""
        if n and lengths.min() < 0:
            bad = "negative sequence length"
        elif n and (pointers[0] != 0 or np.any(np.diff(pointers) != lengths[:-1] * np.int64(self.dtype.itemsize))):
            bad = "sequence pointers do not follow the sequence lengths"
        elif len(di) == 0 or di[0] != 0 or di[-1] != n or np.any(np.diff(di) < 0):
            bad = "document indices do not partition the sequences"
        if bad:
            raise DataError(f"{self.idx_path}: {bad}; the index is corrupt, rebuild it")

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.doc_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(self.doc_starts[i])
        return np.asarray(self.tokens[s : s + int(self.doc_lengths[i])])

    def max_token_id(self) -> int:
        """Largest token id in the .bin (one pass over the mmap)."""
        if self.num_tokens == 0:
            return -1
        chunk, best = 1 << 26, 0
        for s in range(0, self.num_tokens, chunk):
            best = max(best, int(self.tokens[s : s + chunk].max()))
        return best

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if any token id is outside a model vocabulary of ``vocab_size`` (embedding lookup would fail)."""
        top = self.max_token_id()
        if top >= vocab_size:
            raise DataError(
                f"{self.bin_path}: token id {top} >= vocabulary size {vocab_size}; the data was tokenized with "
                "another tokenizer (set data.tokenizer to the one used, or model.vocab_size larger)"
            )
