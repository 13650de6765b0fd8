"""``megasparse preprocess``: tokenize .txt / .jsonl documents into a Megatron indexed dataset.

    megasparse preprocess --input a.jsonl b.txt --tokenizer builtin:shakespeare --output-prefix data/mine

A .txt file holds one document per blank-line-separated block (or one per file with ``--doc-per-file``);
a .jsonl file one document per line under ``--json-key``. Every document ends with the EOD token, so
packing needs no extra separator.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megasparse.data.bpe import eod_id, tokenize_into
from megasparse.data.indexed import DataError, IndexedWriter, optimal_dtype
from megasparse.data.tokenizer import load_tokenizer

_BLANK = re.compile(r"\n[ \t]*\n")


def read_documents(path: str | Path, json_key: str = "text", doc_per_file: bool = False) -> Iterator[str]:
    """Documents of one input file (see the module docstring for the formats)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--input {path}: no such file")
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); one JSON object per line") from e
                if not isinstance(rec, dict) or json_key not in rec:
                    raise DataError(f"{path}:{n}: no key {json_key!r}; pass --json-key with the text field")
                yield str(rec[json_key])
        return
    text = path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    if doc_per_file:
        if text.strip():
            yield text.strip()
        return
    for block in _BLANK.split(text):
        if block.strip():
            yield block.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megasparse preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--tokenizer", default="builtin:shakespeare", help="tokenizers JSON file or builtin:shakespeare")
    ap.add_argument("--json-key", default="text", help="field holding the text in .jsonl inputs")
    ap.add_argument("--doc-per-file", action="store_true", help=".txt inputs: the whole file is one document")
    ap.add_argument("--cache-dir", default=None, help="cache for builtin: tokenizers")
    args = ap.parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer, cache_dir=args.cache_dir)
        eod = eod_id(tok, args.tokenizer)
        vocab = tok.get_vocab_size()
        dtype = optimal_dtype(vocab)
        t0 = time.time()
        docs = (d for path in args.input for d in read_documents(path, args.json_key, args.doc_per_file))
        with IndexedWriter(args.output_prefix, dtype) as w:
            n_docs = tokenize_into(w, tok, docs, eod)
        if n_docs == 0:
            raise DataError(f"--input {' '.join(args.input)}: no documents found")
    except DataError as e:
        print(f"megasparse preprocess: {e}", file=sys.stderr)
        return 2
    mb = (w.bin_path.stat().st_size + w.idx_path.stat().st_size) / 2**20
    print(
        f"wrote {w.bin_path.with_suffix('')}.{{bin,idx}}: {n_docs} documents, {w.num_tokens} tokens "
        f"({w.num_tokens / n_docs:.1f}/doc), {mb:.2f} MB, dtype {np.dtype(dtype).name}, vocab {vocab}, "
        f"eod {eod}, {time.time() - t0:.1f}s"
    )
    return 0
