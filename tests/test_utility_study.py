"""benchmarks/utility_noisy.py: the noisy-mix builder, and the per-kind count of kept tokens on a tiny run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from distributed import run_distributed
from tiny import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import utility_noisy as un  # noqa: E402

EOD = 0
NOISY_IDS = 200  # the tiny run's noisy documents use ids >= 200 only, so a token's kind can be read off its id


def encode(text: str) -> list[int]:
    return [1 + b % 250 for b in text.encode()]


def clean_docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.integers(1, NOISY_IDS, size=int(rng.integers(20, 60))), [EOD]]) for _ in range(n)]


def test_make_mix_replaces_the_share_with_equally_long_noise():
    src = clean_docs(50)
    mix, kinds = un.make_mix(src, EOD, encode, 0.4, seed=7)
    assert np.bincount(kinds, minlength=len(un.KINDS)).tolist() == [30, 7, 7, 6]
    soup_ids = set(encode(un.SOUP_ALPHABET))
    n = len(un.BOILERPLATE)
    units = [encode("".join(un.BOILERPLATE[(a + i) % n] for i in range(2))) for a in range(n)]
    for s, m, k in zip(src, mix, kinds):
        assert len(m) == len(s) and m[-1] == EOD and (m[:-1] != EOD).all()
        body = m[:-1].tolist()
        if un.KINDS[k] == "clean":
            np.testing.assert_array_equal(m, s)
        elif un.KINDS[k] == "shuffled":
            assert sorted(body) == sorted(s[:-1].tolist()) and body != s[:-1].tolist()
        elif un.KINDS[k] == "soup":
            assert set(body) <= soup_ids and len(set(body)) > 10
        else:  # boilerplate: two consecutive lines repeated to length
            assert any(body == np.resize(u, len(body)).tolist() for u in units)
    mix2, kinds2 = un.make_mix(src, EOD, encode, 0.4, seed=7)
    assert (kinds2 == kinds).all() and all((a == b).all() for a, b in zip(mix, mix2))


def test_split_pools_are_disjoint_and_cover_everything():
    pools = un.split_pools(100, 10, 30, seed=3)
    assert [len(pools[k]) for k in ("heldout", "reference", "train")] == [10, 30, 60]
    every = np.concatenate(list(pools.values()))
    assert sorted(every.tolist()) == list(range(100))
    with pytest.raises(ValueError, match="leave none"):
        un.split_pools(10, 5, 5, seed=3)


def _tiny_run(prefix: str, tok: str, kinds: np.ndarray, mode: str, steps: int) -> dict:
    """``steps`` steps with the tracker hooked in, plus an independent count that reads kinds off token ids."""
    from megasparse.config import load_config
    from megasparse.train import Trainer

    over = tiny(data__prefix=prefix, data__tokenizer=tok, data__valid_fraction=0.1, model__vocab_size=300,
                model__num_layers=2, train__micro_batch_size=4, train__global_batch_size=8, filter__mode=mode,
                filter__scorer="loss", filter__keep_ratio=0.5, filter__granularity="microbatch")  # fmt: skip
    tr = Trainer(load_config(None, over))
    tracker = un.KindTracker(tr.train_ds, kinds, selecting=mode != "off")
    tr.train_ds = tracker
    by_id = {"kept_noisy": 0, "kept": 0, "read_noisy": 0, "mismatched": 0}

    def observe(tokens, sel) -> None:
        kind = tracker.observe(tokens, sel)
        by_id["mismatched"] += int(((kind > 0) != (tokens[:, 1:].t() >= NOISY_IDS)).sum())
        keep = sel.loss_mask.cpu()
        by_id["kept_noisy"] += int(((tokens[:, 1:].t() >= NOISY_IDS) & keep).sum())
        by_id["kept"] += int(keep.sum())
        by_id["read_noisy"] += int((tokens[:, 1:] >= NOISY_IDS).sum())

    if tr.filter is not None:  # dense runs never select
        tr.filter.observer = lambda batch, sel: observe(batch.tokens, sel)
    for _ in range(steps):
        tr.train_step()
    return {
        **tracker.counts(),
        "by_id": by_id,
        "kept_rows": tr.filter.kept_rows if tr.filter else None,
        "num_mb": tr.num_mb,
    }


def test_kind_tracker_counts_kept_noise_on_a_tiny_run(tmp_path):
    from megasparse.data.bpe import train_bpe
    from megasparse.data.indexed import write_indexed

    tok = train_bpe([f"line {i} of a tiny corpus" for i in range(50)], 300, tmp_path / "tok.json")
    docs = clean_docs(40, seed=1)
    kinds = np.zeros(len(docs), dtype=np.int8)
    rng = np.random.default_rng(2)
    for i in range(0, len(docs), 3):  # noise without its EOD: the dataset inserts one, which counts as clean
        docs[i], kinds[i] = rng.integers(NOISY_IDS, 300, size=len(docs[i]) - 1), 1 + (i // 3) % 3
    write_indexed(tmp_path / "mix", docs)
    steps, seq = 3, 16
    got = run_distributed(_tiny_run, 1, str(tmp_path / "mix"), str(tok), kinds, "collider", steps)[0]
    seen, kept = got["seen"], got["kept"]
    assert sum(seen.values()) == steps * 8 * seq
    assert sum(kept.values()) == got["by_id"]["kept"] == steps * got["num_mb"] * got["kept_rows"]
    noisy_kept = sum(v for k, v in kept.items() if k != "clean")
    assert noisy_kept == got["by_id"]["kept_noisy"]
    assert sum(v for k, v in seen.items() if k != "clean") == got["by_id"]["read_noisy"]
    assert got["by_id"]["mismatched"] == 0  # every label position attributed to its own document
    assert min(seen.values()) > 0  # all kinds were read, so the checks above could fail
    dense = run_distributed(_tiny_run, 1, str(tmp_path / "mix"), str(tok), kinds, "off", 2)[0]
    assert dense["kept"] == dense["seen"] and sum(dense["seen"].values()) == 2 * 8 * seq
    assert dense["by_id"]["kept"] == 0  # dense never selects


def test_noisy_share():
    c = {"kept": {"clean": 60, "shuffled": 20, "soup": 10, "boilerplate": 10}}
    assert un.noisy_share(c, "kept") == pytest.approx(0.4)
