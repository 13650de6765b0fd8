"""``megasparse ref`` smoke tests on tiny datasets, plus the chunked and windowed scoring loops behind it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from megasparse.cli import main as cli_main
from megasparse.data.indexed import IndexedDataset, write_indexed
from megasparse.filtering import cli as ref_cli
from megasparse.filtering.ngram import NgramLM
from megasparse.filtering.sidecar import open_sidecar

VOCAB, EOD = 64, 0


def _write_corpus(prefix, seed: int, n_docs: int) -> None:
    """Documents from a shared sparse Markov chain, each ending with EOD (like megasparse preprocess)."""
    rng = np.random.default_rng(seed)
    succ = np.random.default_rng(0).integers(1, VOCAB, size=(VOCAB, 3))
    docs = []
    for _ in range(n_docs):
        t = [int(rng.integers(1, VOCAB))]
        for _ in range(int(rng.integers(5, 60))):
            t.append(int(succ[t[-1], rng.integers(0, 3)]))
        docs.append(t + [EOD])
    write_indexed(prefix, docs)


def test_ref_ngram_writes_counts_and_sidecar(tmp_path, capsys) -> None:
    ref, main = tmp_path / "ref", tmp_path / "main"
    _write_corpus(ref, seed=1, n_docs=40)
    _write_corpus(main, seed=2, n_docs=30)
    counts, side = tmp_path / "counts.npz", tmp_path / "main.refloss"
    argv = ["ref", "ngram", "--data", str(ref), "--vocab-size", str(VOCAB), "--eod-id", str(EOD), "--order", "3"]
    argv += ["--out", str(counts), "--sidecar-for", str(main), "--sidecar-out", str(side), "--sidecar-dtype", "float32"]
    assert cli_main(argv) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert "mean NLL" in table[-3] and str(side) in table[-1]
    lm = NgramLM.load(counts)
    assert (lm.order, lm.vocab_size, lm.eod_id) == (3, VOCAB, EOD)
    ds = IndexedDataset(main)
    losses = open_sidecar(side, main)
    expect = lm.stream_losses(np.asarray(ds.tokens), doc_starts=ds.doc_starts)
    np.testing.assert_allclose(losses, expect, rtol=1e-6)
    # in-domain text from the same chain is far more predictable than uniform
    assert float(np.mean(losses)) < np.log(VOCAB) - 1.0


def test_sidecar_chunks_follow_documents(tmp_path, monkeypatch) -> None:
    prefix = tmp_path / "ds"
    _write_corpus(prefix, seed=3, n_docs=25)
    ds = IndexedDataset(prefix)
    lm = NgramLM.fit(np.asarray(ds.tokens), VOCAB, order=3, eod_id=EOD)
    whole = lm.stream_losses(np.asarray(ds.tokens), doc_starts=ds.doc_starts)
    monkeypatch.setattr(ref_cli, "_CHUNK_TOKENS", 37)  # many chunks, each cut at a document start
    chunks = list(ref_cli.ngram_sidecar_chunks(lm, str(prefix)))
    assert len(chunks) > 5
    np.testing.assert_array_equal(np.concatenate(chunks), whole)


@pytest.mark.parametrize("seq_len,overlap,batch", [(16, 2, 3), (16, 8, 1), (1000, 4, 2)])
def test_score_stream_windows(seq_len: int, overlap: int, batch: int) -> None:
    """A causal scorer that needs order-1 tokens of context gives the full-stream losses once windows overlap."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=203)
    tokens[::17] = EOD
    lm = NgramLM.fit(tokens, VOCAB, order=3, eod_id=EOD)
    got = ref_cli.score_stream(lm.token_losses, tokens, seq_len, batch, overlap)
    expect = lm.stream_losses(tokens).astype(np.float32)
    expect[0] = 0.0
    np.testing.assert_allclose(got, expect, rtol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_score_stream_shards_over_ranks(world: int, capsys) -> None:
    """`ref score` under torchrun: each rank scores its share of windows; their sum is the whole stream."""
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=517)
    lm = NgramLM.fit(tokens, VOCAB, order=3, eod_id=EOD)
    whole = ref_cli.score_stream(lm.token_losses, tokens, 32, 2, 8)
    parts = [ref_cli.score_stream(lm.token_losses, tokens, 32, 2, 8, rank=r, world=world) for r in range(world)]
    assert all(np.count_nonzero(p) < np.count_nonzero(whole) for p in parts)  # each rank did only a share
    np.testing.assert_array_equal(np.sum(parts, axis=0), whole)
    ref_cli.score_stream(lm.token_losses, tokens, 32, 2, 8, progress=True)
    assert "tok/s" in capsys.readouterr().err  # the progress bar: tokens/s and time left


def test_ref_errors_are_one_line(tmp_path, capsys) -> None:
    assert cli_main(["ref", "ngram", "--data", str(tmp_path / "nope"), "--vocab-size", "10", "--out", "x.npz"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert cli_main(["ref", "frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err
    # `ref score` on a directory without a checkpoint says so in one line (the trainer's own error)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  seq_length: 16\n")
    prefix = tmp_path / "ds"
    _write_corpus(prefix, seed=4, n_docs=3)
    rc = cli_main(["ref", "score", str(tmp_path), str(cfg), "--data", str(prefix), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no valid checkpoint" in err


def test_entry_point_subprocess(tmp_path) -> None:
    prefix = tmp_path / "ds"
    _write_corpus(prefix, seed=5, n_docs=10)
    out = tmp_path / "c.npz"
    cmd = [sys.executable, "-m", "megasparse", "ref", "ngram", "--data", str(prefix), "--vocab-size", str(VOCAB)]
    res = subprocess.run([*cmd, "--order", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert NgramLM.load(out).order == 2
    p = NgramLM.load(out).token_losses(torch.tensor([1, 2, 3]))
    assert p.shape == (3,) and torch.isfinite(p).all()
