"""Data: built-in corpus, tokenizer, Megatron indexed datasets, packing, blends, the batch order and whole sequences.

Exports are imported lazily so that reading ``megasparse.data.config`` (every config load) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_datasets": "dataset",
    "batch_iterator": "dataset",
    "reference_prefix": "dataset",
    "PackedDataset": "dataset",
    "BlendedDataset": "blend",
    "blend_indices": "blend",
    "TokenizerInfo": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_info": "tokenizer",
    "IndexedDataset": "indexed",
    "IndexedWriter": "indexed",
    "DataError": "indexed",
    "SequenceDataset": "sequences",
    "build_sequence_datasets": "sequences",
    "length_report": "lengths",
    "ensure_builtin": "builtin",
    "builtin_paths": "builtin",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megasparse.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megasparse.data.{_EXPORTS[name]}"), name)
