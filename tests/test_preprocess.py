"""`megasparse preprocess` reads what megatron's tools/preprocess_data.py reads (jsonl, --json-keys, --append-eod)
and writes what it writes: PREFIX_KEY_document.{bin,idx}, byte-identical to megatron-core's IndexedDatasetBuilder
fed the way preprocess_data.py feeds it, so megatron-core's IndexedDataset reads the same token sequences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megasparse.data.bpe import EOD_TOKEN
from megasparse.data.dataset import PackedDataset
from megasparse.data.indexed import IndexedDataset, optimal_dtype
from megasparse.data.preprocess import main as preprocess
from megasparse.data.tokenizer import load_tokenizer

RECORDS = [
    {"text": "to be or not to be", "title": "hamlet"},
    {"text": ["that is ", "", "the question"], "title": "sentences"},  # pre-split: one sequence per sentence
    {"text": "", "title": "empty"},  # tokenizes to nothing: a document of no sequences
    {"text": "whether tis nobler\nin the mind", "title": "newline"},
    {"text": " slings and arrows ", "title": "spaces are kept"},
]


def _megatron_encode(tok, text, eod: int | None) -> tuple[list[int], list[int]]:
    """preprocess_data.py's Encoder.encode for one key: sentences tokenized, empty ones dropped, EOD appended."""
    ids, lens = [], []
    for sentence in text if isinstance(text, list) else [text]:
        s = tok.encode(sentence, add_special_tokens=False).ids
        if s:
            ids += s
            lens.append(len(s))
    if ids and eod is not None:
        ids.append(eod)
        lens[-1] += 1
    return ids, lens


def _write_jsonl(path: Path, n_copies: int = 1) -> None:
    with open(path, "w") as f:
        for _ in range(n_copies):
            for r in RECORDS:
                f.write(json.dumps({**r, "id": 7}) + "\n")


def test_preprocess_jsonl_is_byte_identical_to_megatrons(tmp_path, tiny_tokenizer):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    tok = load_tokenizer(str(tiny_tokenizer))
    eod = tok.token_to_id(EOD_TOKEN)
    _write_jsonl(tmp_path / "a.jsonl")
    args = ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tiny_tokenizer), "--append-eod"]
    assert preprocess([*args, "--output-prefix", str(tmp_path / "ours"), "--json-keys", "text", "title"]) == 0
    for key in ("text", "title"):
        prefix = tmp_path / f"ours_{key}_document"
        # megatron-core's builder, fed as preprocess_data.py feeds it
        builder = mc.IndexedDatasetBuilder(str(tmp_path / f"mc_{key}.bin"), dtype=optimal_dtype(tok.get_vocab_size()))
        expected = []
        for r in RECORDS:
            ids, lens = _megatron_encode(tok, r[key], eod)
            builder.add_document(torch.tensor(ids, dtype=torch.int64), lens)
            expected.append(ids)
        builder.finalize(str(tmp_path / f"mc_{key}.idx"))
        for ext in (".bin", ".idx"):
            assert Path(f"{prefix}{ext}").read_bytes() == (tmp_path / f"mc_{key}{ext}").read_bytes(), (key, ext)
        # megatron-core's reader: each document's sequences concatenate to the expected tokens
        theirs = mc.IndexedDataset(str(prefix), mmap=True)
        di = theirs.document_indices
        assert len(di) == len(RECORDS) + 1
        for d, ids in enumerate(expected):
            seqs = [theirs[i] for i in range(di[d], di[d + 1])]
            got = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
            np.testing.assert_array_equal(got, ids)
            np.testing.assert_array_equal(IndexedDataset(prefix)[d], ids)  # and megasparse's reader
    assert tok.decode(IndexedDataset(tmp_path / "ours_text_document")[1].tolist()[:-1]) == "that is the question"


def test_preprocess_eod_is_optional_for_packing_and_workers_change_nothing(tmp_path, tiny_tokenizer):
    _write_jsonl(tmp_path / "a.jsonl", n_copies=120)  # 600 documents: several worker batches
    base = ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tiny_tokenizer)]
    assert preprocess([*base, "--output-prefix", str(tmp_path / "eod"), "--append-eod"]) == 0
    assert preprocess([*base, "--output-prefix", str(tmp_path / "w2"), "--append-eod", "--workers", "2"]) == 0
    assert preprocess([*base, "--output-prefix", str(tmp_path / "none")]) == 0
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"eod_text_document{ext}").read_bytes()
        assert a == (tmp_path / f"w2_text_document{ext}").read_bytes()
    with_eod, without = IndexedDataset(tmp_path / "eod_text_document"), IndexedDataset(tmp_path / "none_text_document")
    eod = load_tokenizer(str(tiny_tokenizer)).token_to_id(EOD_TOKEN)
    assert without.num_tokens == with_eod.num_tokens - 480 and not (without.tokens == eod).any()  # 4 of 5 non-empty
    # packing inserts the EOD megatron would have stored: the two training streams are the same
    a = PackedDataset(with_eod, np.arange(len(with_eod)), 8, eod, shuffle=False)
    b = PackedDataset(without, np.arange(len(without)), 8, eod, shuffle=False)
    assert len(a) == len(b) > 100
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i].numpy(), b[i].numpy())


def test_preprocess_argument_errors(tmp_path, tiny_tokenizer, capsys):
    _write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.txt").write_text("one\n\ntwo\n")
    base = ["--tokenizer", str(tiny_tokenizer), "--output-prefix", str(tmp_path / "x")]
    cases = {
        ("--input", str(tmp_path / "a.jsonl"), "--json-keys", "body"): "no key 'body'",
        ("--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")): "every input is .jsonl",
        ("--input", str(tmp_path / "a.jsonl"), "--json-key", "a", "--json-keys", "b"): "exclude each other",
        ("--input", str(tmp_path / "a.jsonl"), "--workers", "0"): "at least 1",
    }
    for args, needle in cases.items():
        assert preprocess([*args, *base]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert needle in err, err
    assert not list(tmp_path.glob("x*")), "a failed run left files behind"
