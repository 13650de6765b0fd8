"""Variable-length data: whole documents as sequences (order, resume, EOD, truncation), the long-tail generator,
the length report (and that preprocess keeps jsonl lengths), the ``megasparse data`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megasparse.configbase import ConfigError
from megasparse.data.bpe import EOD_TOKEN
from megasparse.data.config import DataConfig
from megasparse.data.dataset import split_documents
from megasparse.data.indexed import DataError, IndexedDataset, IndexedWriter
from megasparse.data.lengths import format_report, length_report, window_costs
from megasparse.data.longtail import LongTailSpec, longtail_lengths, write_longtail
from megasparse.data.sequences import SequenceDataset, build_sequence_datasets, sequence_splits
from megasparse.data.tokenizer import load_tokenizer, tokenizer_info

EOD = 0


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(prefix, documents as written): some end with EOD, some do not, one is empty, lengths 1..60."""
    rng = np.random.default_rng(5)
    docs = []
    with IndexedWriter(tmp_path_factory.mktemp("seq") / "mixed") as w:
        for i in range(40):
            d = rng.integers(1, 50, size=int(rng.integers(1, 60)))
            d = np.append(d, EOD) if i % 3 else d  # every third document lacks its EOD
            d = d[:0] if i == 7 else d
            w.add_document(d, [] if i == 7 else None)
            docs.append(d)
    return str(w.bin_path)[:-4], docs


def _expected(doc: np.ndarray, max_length: int | None = None) -> np.ndarray:
    full = doc if doc[-1] == EOD else np.append(doc, EOD)
    return full if max_length is None else full[:max_length]


def test_sequences_are_whole_documents_with_their_eod(mixed):
    prefix, docs = mixed
    ds = SequenceDataset(IndexedDataset(prefix), np.arange(len(docs)), EOD, shuffle=False)
    assert len(ds) == len(docs) - 1 and 7 not in ds.doc_ids  # the empty document is no sequence
    for i, d in enumerate(ds.doc_ids):
        np.testing.assert_array_equal(ds.sequence(i), _expected(docs[d]))
        assert ds.lengths[i] == len(ds.sequence(i))
        pos = ds.positions(i)  # .bin offsets; -1 only where the EOD was appended
        assert (pos == -1).sum() == int(docs[d][-1] != EOD) and (pos[:-1] >= 0).all()
    assert ds.num_tokens == sum(len(_expected(docs[d])) for d in ds.doc_ids) and ds.num_truncated == 0


def test_truncation_is_counted_or_a_one_line_error(mixed):
    prefix, docs = mixed
    idx = IndexedDataset(prefix)
    ds = SequenceDataset(idx, np.arange(len(docs)), EOD, max_length=20, shuffle=False)
    long = [d for d in ds.doc_ids if len(_expected(docs[d])) > 20]
    assert ds.num_truncated == len(long) > 0 and ds.lengths.max() == 20
    assert ds.truncated_tokens == sum(len(_expected(docs[d])) - 20 for d in long)
    for i, d in enumerate(ds.doc_ids):
        np.testing.assert_array_equal(ds.sequence(i), _expected(docs[d], 20))  # the first 20, no EOD added
    with pytest.raises(DataError, match=r"more than the maximum sequence length 20") as e:
        SequenceDataset(idx, np.arange(len(docs)), EOD, max_length=20, truncate=False)
    assert "\n" not in str(e.value) and f"({len(long)} such documents)" in str(e.value)


def test_step_sequences_are_seeded_global_and_resume_exactly(mixed):
    prefix, docs = mixed
    cfg = DataConfig(prefix=prefix, valid_fraction=0.2, seed=11)
    train, valid = sequence_splits(IndexedDataset(prefix), cfg, EOD)
    train_ids, valid_ids = split_documents(len(docs), 0.2, 11)  # the documents packing's splits hold
    assert set(train.doc_ids) == set(train_ids) - {7} and set(valid.doc_ids) == set(valid_ids) - {7}
    n = len(train)
    run = [train.step_sequences(s, 5) for s in range(2 * n // 5 + 2)]  # past two epochs
    seen = [g for step in run for g, _ in step]
    assert seen == list(range(len(seen)))
    first = sorted(train.global_index(g) for g in range(n))
    assert first == list(range(n)) and [train.global_index(g) for g in range(n)] != list(range(n))
    assert [train.global_index(g) for g in range(n, 2 * n)] != [train.global_index(g) for g in range(n)]
    # a fresh process resuming at step 3 reads what the uninterrupted run read there
    again, _ = sequence_splits(IndexedDataset(prefix), cfg, EOD)
    for step in (3, len(run) - 1):
        for (g0, a), (g1, b) in zip(run[step], again.step_sequences(step, 5)):
            assert g0 == g1
            np.testing.assert_array_equal(a, b)
        assert again.step_lengths(step, 5).tolist() == [len(t) for _, t in run[step]]
        # what a resumed run reports as trained so far: every earlier sequence's predictions, across epochs
        assert again.predictions_before(step * 5) == sum(len(t) - 1 for prior in run[:step] for _, t in prior)
    assert [valid.global_index(g) for g in range(len(valid))] == list(range(len(valid)))  # valid: file order
    with pytest.raises(ConfigError, match="n >= 1"):
        train.step_sequences(0, 0)


def test_longtail_generator_report_and_build(tmp_path):
    spec = LongTailSpec(docs=400, vocab=1000, max_length=4096, seed=3)
    man = write_longtail(tmp_path / "lt", spec)
    idx = IndexedDataset(tmp_path / "lt")
    lengths = longtail_lengths(spec)
    np.testing.assert_array_equal(idx.doc_lengths, lengths)  # the report's lengths are the generator's
    assert lengths.min() >= 16 and lengths.max() <= 4096 and (lengths > 2048).any()
    assert 0.85 <= (lengths <= 4096 // 8).mean() <= 0.95  # a body at or below max/8 and a tail above it
    assert idx.max_token_id() < 1000 and (idx.tokens[np.cumsum(lengths) - 1] == EOD).all()
    assert (np.asarray(idx.tokens) == EOD).sum() == 400  # EOD ends each document and appears nowhere else
    rep = man["report"]
    assert rep["documents"] == 400 and rep["tokens"] == idx.num_tokens and rep["max"] == lengths.max()
    assert rep["median"] == np.median(lengths) and rep["p90"] == np.percentile(lengths, 90)
    assert sum(b["documents"] for b in rep["histogram"]) == 400
    assert sum(b["tokens"] for b in rep["histogram"]) == idx.num_tokens
    # the written tokenizer makes it a dataset a run can name
    info = tokenizer_info(man["tokenizer"])
    assert info.eod_id == EOD and info.vocab_size == 1000
    cfg = DataConfig(prefix=str(tmp_path / "lt"), tokenizer=man["tokenizer"], valid_fraction=0.05)
    train, valid, vocab = build_sequence_datasets(cfg, max_length=1024)
    assert vocab == 1000 and len(train) + len(valid) == 400
    assert train.num_truncated + valid.num_truncated == (lengths > 1024).sum() > 0
    with pytest.raises(ConfigError, match="data.blend"):
        build_sequence_datasets(DataConfig(blend=[str(tmp_path / "lt")], tokenizer=man["tokenizer"]))
    with pytest.raises(DataError, match="--tail-share=2"):
        LongTailSpec(tail_share=2).check()


def test_window_costs_by_hand():
    w = window_costs(np.array([3, 10, 0, 4, 8]), 8)  # file order; stream boundaries at 8, 16, 24
    assert w["longer_than_seq"] == 1 and w["tokens_in_longer_than_seq"] == 10
    assert w["padded_windows"] == 5 and w["padding_share"] == pytest.approx(1 - 25 / 40)
    # stream [0,3) [3,13) [13,17) [17,25): 8 cuts the second, 16 the third; 24 is inside the fourth
    assert w["packed_windows"] == 4 and w["documents_cut"] == 3
    rep = length_report([1, 2, 3, 4, 0, 1000], seq_length=8)
    assert [(b["lo"], b["documents"]) for b in rep["histogram"]][:3] == [(1, 1), (2, 2), (4, 1)]
    assert rep["empty_documents"] == 1 and rep["min"] == 1 and rep["max"] == 1000
    text = format_report(rep)
    assert "512-1023" in text and "2 documents cut" in text and rep["windows"]["documents_cut"] == 2


def test_preprocess_keeps_jsonl_lengths(tmp_path, tiny_tokenizer):
    """Documents of widely varying length through `megasparse preprocess`: the report reads their lengths."""
    from megasparse.data.preprocess import main as preprocess

    tok = load_tokenizer(str(tiny_tokenizer))
    words = "to be or not that is the question whether tis nobler".split()
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(words, size=n)) for n in (1, 3, 40, 7, 300, 2, 1200, 15)]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["--input", str(tmp_path / "v.jsonl"), "--tokenizer", str(tiny_tokenizer), "--append-eod"]
    assert preprocess([*args, "--output-prefix", str(tmp_path / "v")]) == 0
    want = [len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts]  # + the appended EOD
    idx = IndexedDataset(tmp_path / "v_text_document")
    assert idx.doc_lengths.tolist() == want and max(want) > 50 * min(want)
    rep = length_report(tmp_path / "v_text_document")
    assert rep["tokens"] == sum(want) and rep["min"] == min(want) and rep["max"] == max(want)
    seqs = SequenceDataset(idx, np.arange(len(texts)), tok.token_to_id(EOD_TOKEN), shuffle=False)
    assert seqs.lengths.tolist() == want and seqs.sequence(4)[-1] == tok.token_to_id(EOD_TOKEN)


def test_data_command(tmp_path, capsys):
    from megasparse.cli import main

    assert main(["data", "longtail", "--output-prefix", str(tmp_path / "c"), "--docs", "50", "--max-length", "64"]) == 0
    assert "50 documents" in capsys.readouterr().out
    assert main(["data", "lengths", str(tmp_path / "c"), "--seq-length", "32", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["documents"] == 50 and rep["windows"]["seq_length"] == 32
    assert main(["data", "lengths", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err
    before = (tmp_path / "c.bin").read_bytes()  # a second longtail into the same prefix refuses and writes nothing
    assert main(["data", "longtail", "--output-prefix", str(tmp_path / "c"), "--docs", "9", "--max-length", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "already exist" in err and (tmp_path / "c.bin").read_bytes() == before
