"""``megasparse data``: tools for variable-length data.

megasparse data lengths PREFIX [--seq-length S] [--json]    the length distribution (data/lengths.py)
megasparse data longtail --output-prefix P [--docs N] ...   a long-tail synthetic set (data/longtail.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megasparse.data.indexed import DataError


def _lengths(args: argparse.Namespace) -> int:
    from megasparse.data.lengths import format_report, length_report

    rep = length_report(args.prefix, args.seq_length)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0


def _longtail(args: argparse.Namespace) -> int:
    from megasparse.data.lengths import format_report
    from megasparse.data.longtail import LongTailSpec, write_longtail

    spec = LongTailSpec(
        docs=args.docs,
        vocab=args.vocab,
        max_length=args.max_length,
        seed=args.seed,
        median=args.median,
        sigma=args.sigma,
        tail_share=args.tail_share,
        min_length=min(args.min_length, args.max_length),
        tokens=args.tokens,
    )
    base = args.output_prefix
    taken = [
        f"{base}{ext}" for ext in (".bin", ".idx", ".tokenizer.json", ".longtail.json") if Path(f"{base}{ext}").exists()
    ]
    if taken:  # never replace a dataset someone may be training on
        raise DataError(f"--output-prefix {base}: {', '.join(taken)} already exist; choose another prefix")
    t0 = time.time()
    man = write_longtail(base, spec)
    print(format_report(man["report"]))
    print(f"tokenizer: {man['tokenizer']} (vocab {spec.vocab}, EOD id {man['eod_id']}); {time.time() - t0:.2f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megasparse data", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="tool", required=True)
    ln = sub.add_parser("lengths", help="document length distribution of an indexed dataset")
    ln.add_argument("prefix", help="indexed dataset prefix (PREFIX.bin/.idx)")
    ln.add_argument("--seq-length", type=int, default=None, help="also report what windows of S tokens cost")
    ln.add_argument("--json", action="store_true", help="print the report as JSON")
    lt = sub.add_parser("longtail", help="write a synthetic dataset with long-tail document lengths")
    lt.add_argument("--output-prefix", required=True)
    lt.add_argument("--docs", type=int, default=10000, help="number of documents")
    lt.add_argument("--vocab", type=int, default=32000, help="vocabulary size (ids in [1, vocab), EOD = 0)")
    lt.add_argument("--max-length", type=int, default=32768, help="longest document, EOD included")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--median", type=float, default=None, help="the body's median length (default max-length/40)")
    lt.add_argument("--sigma", type=float, default=0.95, help="the body's log-normal sigma")
    lt.add_argument("--tail-share", type=float, default=0.05, help="share of documents log-uniform in [max/8, max]")
    lt.add_argument("--min-length", type=int, default=16, help="shortest document, EOD included")
    lt.add_argument("--tokens", choices=("zipf", "uniform"), default="zipf", help="token id distribution")
    args = ap.parse_args(argv)
    try:
        if args.tool == "lengths" and args.seq_length is not None and args.seq_length < 1:
            raise DataError(f"--seq-length={args.seq_length}: give at least 1")
        return _lengths(args) if args.tool == "lengths" else _longtail(args)
    except DataError as e:
        print(f"megasparse data {args.tool}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
