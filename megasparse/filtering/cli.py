"""``megasparse ref``: build reference losses for token filtering.

    megasparse ref ngram --data PREFIX --tokenizer T [--order 3] --out counts.npz [--sidecar-for PREFIX2]
    megasparse ref score CHECKPOINT_DIR CONFIG.yaml --data PREFIX --out SIDECAR [key.sub=value ...]
    megasparse ref score CHECKPOINT_DIR CONFIG.yaml --data PREFIX --max-tokens N     # a trial: no sidecar

``--data`` takes an indexed-dataset prefix, or ``builtin:milton`` / ``builtin:shakespeare`` for the bundled
corpora (the Milton texts are the intended reference corpus for the Shakespeare training set).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from megasparse.configbase import ConfigError, parse_with_overrides
from megasparse.filtering.ngram import NgramLM
from megasparse.filtering.sidecar import write_sidecar

__all__ = ["main", "ngram_sidecar_chunks", "score_stream"]

_CHUNK_TOKENS = 1 << 22


def _resolve_prefix(spec: str, tokenizer: str | None) -> str:
    if not spec.startswith("builtin:"):
        return spec
    from megasparse.data.builtin import ensure_builtin

    if spec not in ("builtin:milton", "builtin:shakespeare"):
        raise ConfigError(f"--data {spec}: built-in datasets are builtin:milton and builtin:shakespeare")
    if tokenizer not in (None, "builtin:shakespeare"):
        raise ConfigError(f"--data {spec} is tokenized with builtin:shakespeare; drop --tokenizer {tokenizer}")
    paths = ensure_builtin("builtin:shakespeare", builder=True)
    return paths.reference_prefix if spec == "builtin:milton" else paths.prefix


def _vocab(args: argparse.Namespace) -> tuple[int, int | None]:
    """(vocab size, eod id) from --tokenizer, or from --vocab-size/--eod-id."""
    if args.vocab_size is not None:
        return args.vocab_size, args.eod_id
    if args.tokenizer is None and not args.data.startswith("builtin:"):
        raise ConfigError("megasparse ref ngram needs --tokenizer (or --vocab-size) to know the vocabulary")
    from megasparse.data.tokenizer import tokenizer_info

    info = tokenizer_info(args.tokenizer or "builtin:shakespeare")
    return info.vocab_size, info.eod_id if args.eod_id is None else args.eod_id


def ngram_sidecar_chunks(lm: NgramLM, prefix: str) -> Iterator[np.ndarray]:
    """Losses of every token of ``prefix`` in order, in document-aligned chunks (bounded memory)."""
    from megasparse.data.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    starts = np.asarray(ds.doc_starts, dtype=np.int64)
    begin = 0
    while begin < ds.num_tokens:
        # end the chunk at the first document start past begin + _CHUNK_TOKENS (or the end of the data)
        j = np.searchsorted(starts, begin + _CHUNK_TOKENS, side="left")
        end = int(starts[j]) if j < len(starts) else ds.num_tokens
        rel = starts[(starts >= begin) & (starts < end)] - begin
        yield lm.stream_losses(np.asarray(ds.tokens[begin:end]), doc_starts=rel)
        begin = end


def score_stream(
    token_losses: Callable[[torch.Tensor], torch.Tensor],
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 8,
    overlap: int | None = None,
    device: str | torch.device = "cpu",
    rank: int = 0,
    world: int = 1,
    progress: bool = False,
) -> np.ndarray:
    """Per-token losses of a flat stream with a causal scorer that sees ``seq_len`` tokens at a time.

    ``token_losses(windows [seq_len, b]) -> [seq_len, b]`` gives the loss of each token from its prefix inside
    the window. Windows overlap by ``overlap`` tokens (default seq_len // 4) and only positions with at least
    that much context are kept, so every token but the first ``overlap`` of the stream is scored with
    ``overlap``+ tokens of context. Token 0 has no prefix and gets 0.

    With ``world`` > 1 this rank scores every ``world``-th batch of windows (starting at ``rank``) and leaves the
    other tokens 0: every token belongs to exactly one window, so summing the ranks' arrays gives the stream.
    ``progress`` shows a bar with tokens/s and the time left (on stderr).
    """
    overlap = seq_len // 4 if overlap is None else overlap
    if not 0 <= overlap < seq_len:
        raise ValueError(f"overlap {overlap} must be in [0, seq_len={seq_len})")
    n = len(tokens)
    stride = seq_len - overlap
    starts = list(range(0, max(n - overlap, 1), stride))
    out = np.zeros(n, dtype=np.float32)
    batches = list(range(0, len(starts), batch_size))[rank::world]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="tok", unit_scale=True, desc="ref score", mininterval=2.0, file=sys.stderr)
    for i in batches:
        group = starts[i : i + batch_size]
        win = np.zeros((len(group), seq_len), dtype=np.int64)
        for r, st in enumerate(group):
            piece = np.asarray(tokens[st : st + seq_len], dtype=np.int64)
            win[r, : len(piece)] = piece  # tail padding: causal scoring never lets it reach earlier tokens
        with torch.no_grad():
            losses = token_losses(torch.from_numpy(win.T.copy()).to(device)).float().cpu().numpy().T
        for r, st in enumerate(group):
            lo = 0 if st == 0 else overlap
            hi = min(seq_len, n - st)
            out[st + lo : st + hi] = losses[r, lo:hi]
        if bar is not None:  # every rank scores about the same share: this rank's progress times world
            bar.update(min(n - bar.n, world * sum(min(stride, n - st) for st in group)))
    if bar is not None:
        bar.close()
    if n:
        out[0] = 0.0
    return out


def _cmd_ngram(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megasparse ref ngram", description="fit a Kneser-Ney n-gram reference")
    ap.add_argument("--data", required=True, help="reference corpus: indexed prefix or builtin:milton")
    ap.add_argument("--tokenizer", default=None, help="tokenizers JSON or builtin:shakespeare (vocab size, eod id)")
    ap.add_argument("--vocab-size", type=int, default=None, help="instead of --tokenizer")
    ap.add_argument("--eod-id", type=int, default=None, help="end-of-document id (default: the tokenizer's)")
    ap.add_argument("--order", type=int, default=3)
    ap.add_argument("--out", required=True, help="counts file (.npz) for filter.ngram_path")
    ap.add_argument("--sidecar-for", default=None, help="also write a reference-loss sidecar for this dataset")
    ap.add_argument("--sidecar-out", default=None, help="sidecar path (default PREFIX2.refloss)")
    ap.add_argument("--sidecar-dtype", default="float16", choices=["float16", "float32"])
    args = ap.parse_args(argv)
    from megasparse.data.indexed import IndexedDataset

    t0 = time.time()
    vocab, eod = _vocab(args)
    ds = IndexedDataset(_resolve_prefix(args.data, args.tokenizer))
    lm = NgramLM.fit(np.asarray(ds.tokens), vocab, order=args.order, eod_id=eod, doc_starts=ds.doc_starts)
    lm.save(args.out)
    ref_nll = float(np.mean(lm.stream_losses(np.asarray(ds.tokens), doc_starts=ds.doc_starts)))
    rows = [("reference corpus", ds.prefix, ds.num_tokens, ref_nll)]
    if args.sidecar_for:
        prefix2 = _resolve_prefix(args.sidecar_for, args.tokenizer)
        out2 = args.sidecar_out or f"{prefix2}.refloss"
        total, count = 0.0, 0

        def counted() -> Iterator[np.ndarray]:
            nonlocal total, count
            for chunk in ngram_sidecar_chunks(lm, prefix2):
                total, count = total + float(chunk.sum()), count + chunk.size
                yield chunk

        write_sidecar(out2, prefix2, counted(), dtype=args.sidecar_dtype)
        rows.append((f"sidecar -> {out2}", prefix2, count, total / max(count, 1)))
    print(f"order-{args.order} KN n-gram, vocab {vocab}, saved {args.out} ({time.time() - t0:.1f}s)")
    print(f"{'what':<40} {'tokens':>10} {'mean NLL (nats)':>16}  prefix")
    for what, prefix, n, nll in rows:
        print(f"{what:<40} {n:>10} {nll:>16.4f}  {prefix}")
    return 0


def _cmd_score(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megasparse ref score", description="reference losses from a checkpoint")
    ap.add_argument("checkpoint")
    ap.add_argument("config")
    ap.add_argument("--data", required=True, help="indexed prefix to score (or builtin:shakespeare)")
    ap.add_argument("--out", default=None, help="sidecar path (set data.ref_losses to it)")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="score only the first N tokens and report the mean loss, tokens/s and the time the whole data would "
        "take; writes no sidecar (a sidecar must cover every token)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--overlap", type=int, default=None, help="context tokens carried between windows")
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parse_with_overrides(ap, argv)
    import torch.distributed as dist

    from megasparse.config import load_config
    from megasparse.data.indexed import IndexedDataset
    from megasparse.model.builder import load_model_for_inference
    from megasparse.parallel import comm

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: score at least one token")
    if (args.out is None) == (args.max_tokens is None):
        raise ConfigError(
            "give --out SIDECAR (score every token) or --max-tokens N (a trial on the first N tokens, no sidecar)"
        )
    cfg = load_config(args.config, args.overrides)
    model = load_model_for_inference(cfg, args.checkpoint)  # under torchrun: one replica per rank
    prefix = _resolve_prefix(args.data, None)
    ds = IndexedDataset(prefix)
    tokens = ds.tokens if args.max_tokens is None else ds.tokens[: args.max_tokens]
    device = next(model.parameters()).device if hasattr(model, "parameters") else "cpu"
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    t0 = time.time()
    losses = score_stream(
        model.token_losses, tokens, cfg.model.seq_length, args.batch_size, args.overlap, device=device,
        rank=rank, world=world, progress=rank == 0,
    )  # fmt: skip
    if world > 1:  # each rank scored its own windows; every token in exactly one of them
        t = torch.from_numpy(losses).to(device)
        comm.all_reduce(t, None, "world", region="ref.score")
        losses = t.cpu().numpy()
    if rank == 0:
        if args.out is not None:
            write_sidecar(args.out, prefix, losses, dtype=args.dtype)
        secs = max(time.time() - t0, 1e-9)
        n = len(losses)
        whole = _hms(ds.num_tokens * secs / max(n, 1))
        where = args.out or f"none (--max-tokens; all {ds.num_tokens} tokens would take ~{whole})"
        print(f"{'tokens':>10} {'mean NLL (nats)':>16} {'tokens/s':>10} {'ranks':>6}  sidecar")
        mean = float(losses.mean()) if losses.size else 0.0
        print(f"{n:>10} {mean:>16.4f} {n / secs:>10.0f} {world:>6}  {where}")
    return 0


def _hms(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


_SUBCOMMANDS = {"ngram": _cmd_ngram, "score": _cmd_score}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _SUBCOMMANDS:
        print("usage: megasparse ref {ngram,score} ...  (see --help of each)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        return _SUBCOMMANDS[argv[0]](argv[1:])
    except (ConfigError, NotImplementedError, FileNotFoundError) as e:
        print(f"megasparse ref {argv[0]}: {e}", file=sys.stderr)
        return 2
