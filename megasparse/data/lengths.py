"""The length distribution of an indexed dataset's documents, and what fixed windows of S tokens make of it.

    megasparse data lengths PREFIX [--seq-length S] [--json]

Lengths come from the ``.idx`` alone (one document = the tokens its sequences hold, EOD included where the
data stores it), so the report is instant on any size. :func:`length_report` returns the dict the command
prints; the ChunkFlow benchmark writes it into its JSON and a trainer banner may quote it.

With ``seq_length`` S it adds what two fixed-length schemes do with these documents:

* fixed length with padding (megatron-core's ``mcore-fixed`` in the benchmark): every document occupies
  ``ceil(L / S)`` windows of S, the rest padding; ``padding_share`` is the padded share of those slots;
* packing (megasparse's windows): the document stream cut every S tokens, no padding, but
  ``documents_cut`` documents straddle a window boundary (document attention keeps their halves apart).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["format_report", "length_report", "window_costs"]


def _lengths_of(source) -> tuple[np.ndarray, str | None]:
    """(int64 document lengths, prefix or None) of a prefix, an IndexedDataset or an array of lengths."""
    from megasparse.data.indexed import IndexedDataset

    if isinstance(source, IndexedDataset):
        return source.doc_lengths.astype(np.int64), source.prefix
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        ds = IndexedDataset(source)
        return ds.doc_lengths.astype(np.int64), ds.prefix
    return np.asarray(source, dtype=np.int64), None


def length_report(source, seq_length: int | None = None) -> dict:
    """Document count, tokens, min/median/mean/p90/p99/max, power-of-two histogram and (with ``seq_length``)
    what padding and packing to S tokens cost. ``source``: a prefix, an ``IndexedDataset`` or lengths."""
    lengths, prefix = _lengths_of(source)
    n = len(lengths)
    nonempty = lengths[lengths > 0]
    rep: dict = {
        "prefix": prefix,
        "documents": int(n),
        "empty_documents": int(n - len(nonempty)),
        "tokens": int(lengths.sum()),
    }
    if len(nonempty):
        q = np.percentile(nonempty, [50, 90, 99])
        rep.update(
            min=int(nonempty.min()),
            median=float(q[0]),
            mean=float(nonempty.mean()),
            p90=float(q[1]),
            p99=float(q[2]),
            max=int(nonempty.max()),
        )
        # bucket k holds lengths in [2^k, 2^(k+1))
        k = np.floor(np.log2(nonempty)).astype(np.int64)
        rep["histogram"] = [
            {
                "lo": 1 << int(b),
                "hi": (1 << int(b) + 1) - 1,
                "documents": int((k == b).sum()),
                "tokens": int(nonempty[k == b].sum()),
            }
            for b in range(int(k.min()), int(k.max()) + 1)
        ]
    if seq_length is not None:
        rep["windows"] = window_costs(lengths, seq_length)
    return rep


def window_costs(lengths: np.ndarray, seq_length: int) -> dict:
    """What windows of ``seq_length`` tokens do with documents of ``lengths`` (file order): see the module."""
    s = int(seq_length)
    if s < 1:
        raise ValueError(f"seq_length={s} must be >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    nonempty = lengths[lengths > 0]
    tokens = int(nonempty.sum())
    slots = int((-(-nonempty // s)).sum() * s)  # ceil(L / S) windows of S each
    ends = np.cumsum(nonempty)
    starts = ends - nonempty
    # a boundary at a multiple of S strictly inside (start, end) cuts the document
    cut = int(((ends - 1) // s > starts // s).sum())
    return {
        "seq_length": s,
        "longer_than_seq": int((nonempty > s).sum()),
        "longer_than_seq_share": float((nonempty > s).mean()) if len(nonempty) else 0.0,
        "tokens_in_longer_than_seq": int(nonempty[nonempty > s].sum()),
        "padded_windows": slots // s,
        "padding_share": 1.0 - tokens / slots if slots else 0.0,
        "packed_windows": math.ceil(tokens / s),
        "documents_cut": cut,
    }


def format_report(rep: dict, width: int = 40) -> str:
    """The report as text: the summary, the histogram with bars by document count, the window costs."""
    lines = [
        f"{rep['prefix'] or 'lengths'}: {rep['documents']} documents ({rep['empty_documents']} empty), "
        f"{rep['tokens']} tokens"
    ]
    if "max" in rep:
        lines.append(
            f"length: min {rep['min']}  median {rep['median']:.0f}  mean {rep['mean']:.1f}  p90 {rep['p90']:.0f}  "
            f"p99 {rep['p99']:.0f}  max {rep['max']}"
        )
        top = max(b["documents"] for b in rep["histogram"]) or 1
        lines.append(f"{'tokens per document':<21} {'documents':>10} {'docs %':>7} {'tokens %':>8}")
        for b in rep["histogram"]:
            bar = "#" * math.ceil(width * b["documents"] / top) if b["documents"] else ""
            lines.append(
                f"{b['lo']:>10}-{b['hi']:<10} {b['documents']:>10} {100 * b['documents'] / rep['documents']:6.1f}% "
                f"{100 * b['tokens'] / max(1, rep['tokens']):7.1f}% {bar}"
            )
    w = rep.get("windows")
    if w:
        s = w["seq_length"]
        lines += [
            f"windows of {s} tokens:",
            f"  longer than {s}: {w['longer_than_seq']} documents ({100 * w['longer_than_seq_share']:.1f}%), "
            f"{w['tokens_in_longer_than_seq']} tokens",
            f"  fixed length with padding: {w['padded_windows']} windows, {100 * w['padding_share']:.1f}% of their "
            "slots are padding",
            f"  packing: {w['packed_windows']} windows, no padding, {w['documents_cut']} documents cut at a window "
            "boundary",
        ]
    return "\n".join(lines)
