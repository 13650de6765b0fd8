"""``megasparse preprocess``: tokenize .jsonl / .txt documents into Megatron indexed datasets.

    megasparse preprocess --input a.jsonl --output-prefix data/a --tokenizer tok.json --append-eod --workers 4

Megatron's ``tools/preprocess_data.py`` inputs and outputs: each line of a .jsonl file is one document, its
text under each of ``--json-keys`` (default ``text``; a list of strings counts as sentences, one sequence each),
and key ``K`` is written to ``PREFIX_K_document.bin/.idx``. ``--append-eod`` appends the EOD token to every
non-empty document, as megatron does; without it no EOD is stored and megasparse's packing inserts one between
documents (``positions`` -1), so training sees the same stream either way. Documents are encoded without special
tokens; a document with no tokens is stored as megatron stores it (no sequences). ``--workers N`` tokenizes in
``N`` processes; the output does not depend on it.

The older form stays: with ``--json-key K`` (one key), or when every input is a .txt file (one document per
blank-line-separated block, or per file with ``--doc-per-file``), the output is ``PREFIX.bin/.idx`` and every
document ends with EOD.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megasparse.data.bpe import eod_id
from megasparse.data.indexed import DataError, IndexedWriter, optimal_dtype
from megasparse.data.tokenizer import load_tokenizer, resolve_tokenizer_path

_BLANK = re.compile(r"\n[ \t]*\n")
_BATCH = 256  # documents per encode call (and per worker task)

Doc = list[str]
"""One document of one key: its sentences (a plain text is one sentence)."""


def _bad_key(path: Path, n: int, key: str) -> DataError:
    return DataError(f"{path}:{n}: no key {key!r}; pass --json-keys (or --json-key) with the text field")


def read_records(path: str | Path, keys: list[str]) -> Iterator[list[Doc]]:
    """Per .jsonl line, the document of every key in ``keys`` (a string, or a list of sentence strings)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--input {path}: no such file")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); one JSON object per line") from e
            if not isinstance(rec, dict):
                raise _bad_key(path, n, keys[0])
            docs = []
            for key in keys:
                if key not in rec:
                    raise _bad_key(path, n, key)
                text = rec[key]
                docs.append([str(t) for t in text] if isinstance(text, list) else [str(text)])
            yield docs


def read_documents(path: str | Path, json_key: str = "text", doc_per_file: bool = False) -> Iterator[str]:
    """Documents of one input file: a .jsonl line's ``json_key`` text, or a .txt file's blocks (or whole file)."""
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        for (doc,) in read_records(path, [json_key]):
            yield "".join(doc)
        return
    if not path.is_file():
        raise DataError(f"--input {path}: no such file")
    text = path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    if doc_per_file:
        if text.strip():
            yield text.strip()
        return
    for block in _BLANK.split(text):
        if block.strip():
            yield block.strip()


def encode_docs(tok, docs: list[Doc], eod: int | None, eod_empty: bool = False) -> list[tuple[np.ndarray, list[int]]]:
    """(token ids, sequence lengths) per document: each non-empty sentence is a sequence; ``eod`` (if given)
    ends every non-empty document, counted in its last sequence — megatron's ``Encoder.encode``. ``eod_empty``: an
    empty document is ``[eod]`` (the older ``--json-key`` form, where every document ends with EOD)."""
    flat = [s for d in docs for s in d]
    encoded = iter(tok.encode_batch(flat, add_special_tokens=False)) if flat else iter(())
    out = []
    for d in docs:
        ids: list[int] = []
        lens: list[int] = []
        for _ in d:
            sent = next(encoded).ids
            if sent:
                ids.extend(sent)
                lens.append(len(sent))
        if eod is not None and (ids or eod_empty):
            ids.append(eod)
            if lens:
                lens[-1] += 1
            else:
                lens.append(1)
        out.append((np.asarray(ids, dtype=np.int64), lens))
    return out


_worker: tuple = ()


def _init_worker(tokenizer_path: str, eod: int | None, eod_empty: bool) -> None:
    global _worker
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the processes are the parallelism
    _worker = (load_tokenizer(tokenizer_path), eod, eod_empty)


def _encode_in_worker(docs: list[Doc]) -> list[tuple[np.ndarray, list[int]]]:
    return encode_docs(*_worker[:1], docs, *_worker[1:])


def _batches(records: Iterable[list[Doc]]) -> Iterator[list[Doc]]:
    """Flat batches of documents, key-major within each record (record r's key k is entry r*K + k)."""
    buf: list[Doc] = []
    for rec in records:
        buf.extend(rec)
        if len(buf) >= _BATCH:
            yield buf
            buf = []
    if buf:
        yield buf


def write_datasets(
    writers: list[IndexedWriter],
    records: Iterable[list[Doc]],
    tokenizer_path: str,
    eod: int | None,
    workers: int = 1,
    eod_empty: bool = False,
    tok=None,
) -> int:
    """Tokenize ``records`` (one document per writer each) into ``writers``; returns the number of records.
    ``tok``: the tokenizer already loaded from ``tokenizer_path`` (workers load their own)."""
    n_keys, n_docs = len(writers), 0
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizer threads already ran
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path, eod, eod_empty))
        encoded = pool.imap(_encode_in_worker, _batches(records))
    else:
        tok = tok or load_tokenizer(tokenizer_path)
        pool = None
        encoded = (encode_docs(tok, b, eod, eod_empty) for b in _batches(records))
    try:
        with tqdm(desc="tokenizing", unit="doc", file=sys.stderr, mininterval=0.5) as bar:
            for batch in encoded:
                for i, (ids, lens) in enumerate(batch):
                    writers[i % n_keys].add_document(ids, lens)
                n_docs += len(batch) // n_keys
                bar.update(len(batch) // n_keys)
    finally:
        if pool is not None:
            pool.terminate()
    return n_docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megasparse preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True, help=".jsonl (or .txt) files")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.{bin,idx} (see --json-key)")
    ap.add_argument("--tokenizer", default="builtin:shakespeare", help="tokenizers JSON file or builtin:shakespeare")
    ap.add_argument("--json-keys", nargs="+", default=None, help="fields to tokenize, one dataset each (default text)")
    ap.add_argument("--json-key", default=None, help="older form: one field, written to PREFIX.{bin,idx} with EOD")
    ap.add_argument("--append-eod", action="store_true", help="end every non-empty document with EOD (megatron's)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes (output is the same for any N)")
    ap.add_argument("--doc-per-file", action="store_true", help=".txt inputs: the whole file is one document")
    ap.add_argument("--cache-dir", default=None, help="cache for builtin: tokenizers")
    args = ap.parse_args(argv)
    writers: list[IndexedWriter] = []
    try:
        if args.workers < 1:
            raise DataError(f"--workers {args.workers}: give at least 1")
        if args.json_key is not None and args.json_keys is not None:
            raise DataError("--json-key and --json-keys exclude each other; use --json-keys K (PREFIX_K_document)")
        legacy = args.json_key is not None or all(not p.endswith((".jsonl", ".json")) for p in args.input)
        keys = [args.json_key or "text"] if legacy else args.json_keys or ["text"]
        tok_path = str(resolve_tokenizer_path(args.tokenizer, cache_dir=args.cache_dir))
        tok = load_tokenizer(tok_path)
        eod = eod_id(tok, args.tokenizer)
        vocab = tok.get_vocab_size()
        dtype = optimal_dtype(vocab)
        t0 = time.time()
        if legacy:
            docs = (d for path in args.input for d in read_documents(path, keys[0], args.doc_per_file))
            records: Iterable[list[Doc]] = ([[d]] for d in docs)
            prefixes = [args.output_prefix]
        else:
            bad = [p for p in args.input if not p.endswith((".jsonl", ".json"))]
            if bad:
                raise DataError(f"--input {bad[0]}: with --json-keys every input is .jsonl (or use --json-key)")
            records = (r for path in args.input for r in read_records(path, keys))
            prefixes = [f"{args.output_prefix}_{k}_document" for k in keys]
        writers = [IndexedWriter(p, dtype) for p in prefixes]
        n_docs = write_datasets(
            writers, records, tok_path, eod if legacy or args.append_eod else None, args.workers, legacy, tok
        )
        if n_docs == 0:
            raise DataError(f"--input {' '.join(args.input)}: no documents found")
        for w in writers:
            w.close()
    except DataError as e:
        print(f"megasparse preprocess: {e}", file=sys.stderr)
        return 2
    finally:
        for w in writers:
            w.abort()  # no-op once closed; otherwise drops the temporary .bin
    eods = "EOD appended" if legacy or args.append_eod else "no EOD stored (packing inserts it)"
    for w in writers:
        mb = (w.bin_path.stat().st_size + w.idx_path.stat().st_size) / 2**20
        print(
            f"wrote {w.bin_path.with_suffix('')}.{{bin,idx}}: {n_docs} documents, {w.num_tokens} tokens "
            f"({w.num_tokens / n_docs:.1f}/doc), {mb:.2f} MB, dtype {np.dtype(dtype).name}, vocab {vocab}, "
            f"eod {eod}: {eods}, {time.time() - t0:.1f}s"
        )
    return 0
