"""data.blend (issue 16): Megatron's greedy blend index (bit-identical to megatron-core's C++), blended samples
from three corpora made by `megasparse preprocess` (proportions, determinism, resume, the validation split), the
config forms and errors, one reference-loss sidecar per corpus, and a short `megasparse train` run on a blend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.data.blend import BlendedDataset, BlendIndex, blend_indices
from megasparse.data.config import DataConfig
from megasparse.data.dataset import PackedDataset, build_datasets, iterate_batches
from megasparse.data.indexed import IndexedDataset

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = [0.2, 0.5, 0.3]
WORDS = [
    "to be or not that is the question whether tis nobler".split(),
    "in the mind suffer slings and arrows of outrageous fortune".split(),
    "or take arms against a sea of troubles and by opposing end them".split(),
]


def _megatron_helpers():
    pytest.importorskip("megatron.core.datasets.helpers_cpp")
    from megatron.core.datasets import helpers

    return helpers


def _megatron_blend(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """megatron-core's C++ build_blending_indices on normalised weights (as BlendedDataset calls it)."""
    helpers = _megatron_helpers()
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(di, dsi, w, len(w), size, False)
    return di, dsi


# ---------------------------------------------------------------- the blend index


BLENDS = {
    "three": [0.3, 0.5, 0.2],
    "unnormalised": [3, 1, 7, 2],
    "tiny_weight": [0.7, 0.2999, 0.0001],
    "two_equal": [1, 1],
    "one": [5],
    "random8": list(np.random.default_rng(0).dirichlet(np.ones(8))),
    "random16_skewed": list(np.random.default_rng(1).dirichlet(np.full(16, 0.3)) + 1e-6),
}


@pytest.mark.parametrize("backend", ["c", "numpy"])
@pytest.mark.parametrize("name", list(BLENDS))
def test_blend_index_is_megatron_cores_bit_for_bit(name, backend):
    weights = BLENDS[name]
    sizes = (1, 5, 777, 300_001) if backend == "c" or name != "random16_skewed" else (1, 5, 777, 20_001)
    for size in sizes:
        ref_di, ref_dsi = _megatron_blend(weights, size)
        di, dsi, counts = blend_indices(weights, size, backend=backend)
        assert di.dtype == np.int16 and dsi.dtype == np.int64
        np.testing.assert_array_equal(di, ref_di)
        np.testing.assert_array_equal(dsi, ref_dsi)
        np.testing.assert_array_equal(counts, np.bincount(ref_di, minlength=len(weights)))
    # continuing from the counts where a build stopped gives the same entries (how the index grows)
    ref_di, ref_dsi = _megatron_blend(weights, 60_000)
    a_di, a_dsi, counts = blend_indices(weights, 31_337, backend=backend)
    b_di, b_dsi, _ = blend_indices(weights, 60_000 - 31_337, start=31_337, counts=counts, backend=backend)
    np.testing.assert_array_equal(np.concatenate([a_di, b_di]), ref_di)
    np.testing.assert_array_equal(np.concatenate([a_dsi, b_dsi]), ref_dsi)


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_blend_index_entries_do_not_depend_on_how_it_grew(backend):
    ref_di, ref_dsi = _megatron_blend(WEIGHTS, 50_000)
    for min_grow in (1, 1000, 1 << 16):
        index = BlendIndex(WEIGHTS, min_grow=min_grow, backend=backend)
        probes = [0, 3, 49_999, 17, 20_000, 1, 4096]  # out of order: later probes grow it, earlier reuse it
        for g in probes:
            assert index[g] == (ref_di[g], ref_dsi[g])
    with pytest.raises(ValueError, match="positive"):
        BlendIndex([0.5, 0.0])


def test_blend_kernel_is_compiled_once_and_cached(tmp_path, monkeypatch):
    """The C loop builds into the cache directory on first use; without a compiler the numpy build is used."""
    from megasparse.data import blend_kernel

    monkeypatch.setenv("MEGASPARSE_CACHE", str(tmp_path))
    monkeypatch.setattr(blend_kernel, "_lib", False)
    assert blend_kernel.load() is not None
    assert len(list(tmp_path.glob("blend-kernel-*/blend.so"))) == 1
    monkeypatch.setattr(blend_kernel, "_lib", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MEGASPARSE_CACHE", str(tmp_path / "other"))
    assert blend_kernel.load() is None  # compile fails: logged, numpy from now on
    assert blend_indices(WEIGHTS, 1000)[0].tolist() == _megatron_blend(WEIGHTS, 1000)[0].tolist()


# ---------------------------------------------------------------- three corpora from `megasparse preprocess`


def _jsonl(path: Path, words: list[str], n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(8, 30)))), "id": i}) + "\n")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """Tokenizer, three `preprocess`ed corpora (the third without stored EODs), one random sidecar each."""
    from megasparse.data.bpe import train_bpe
    from megasparse.data.preprocess import main as preprocess
    from megasparse.filtering.sidecar import write_sidecar

    d = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    tok = train_bpe([" ".join(rng.choice(sum(WORDS, []), size=30)) for _ in range(200)], 300, d / "tok.json")
    prefixes, sidecars = [], []
    for k, words in enumerate(WORDS):
        _jsonl(d / f"c{k}.jsonl", words, 40 + 20 * k, seed=k)
        eod = ["--append-eod"] if k < 2 else []
        args = ["--input", str(d / f"c{k}.jsonl"), "--output-prefix", str(d / f"c{k}"), "--tokenizer", str(tok)]
        assert preprocess(args + eod) == 0
        prefix = str(d / f"c{k}_text_document")
        n = IndexedDataset(prefix).num_tokens
        sidecars.append(str(write_sidecar(d / f"c{k}.refloss", prefix, rng.random(n, dtype=np.float32) * 5, "float32")))
        prefixes.append(prefix)
    blend = [x for w, p in zip(WEIGHTS, prefixes) for x in (w, p)]
    return {"tok": str(tok), "prefixes": prefixes, "sidecars": sidecars, "blend": blend, "dir": d}


SEQ = 16


def _build(corpora, **kw) -> tuple[BlendedDataset, BlendedDataset]:
    cfg = DataConfig(blend=corpora["blend"], tokenizer=corpora["tok"], valid_fraction=0.1, seed=5, **kw)
    cfg.validate()
    train, valid, _ = build_datasets(cfg, seq_length=SEQ)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    return train, valid


def _corpus_of(ds: BlendedDataset, pos: np.ndarray) -> int:
    real = pos[pos >= 0]
    ks = np.searchsorted(ds.offsets, real, side="right") - 1
    assert len(set(ks.tolist())) == 1, "a sample mixes corpora"
    return int(ks[0])


def test_blend_proportions_determinism_and_tokens(corpora):
    train, _ = _build(corpora)
    n = 10_000
    batches = [b for _, b in zip(range(n // 50), iterate_batches(train, 50))]
    pos = torch.cat([b.positions for b in batches]).numpy()
    toks = torch.cat([b.tokens for b in batches]).numpy()
    which = np.array([_corpus_of(train, p) for p in pos])
    share = np.bincount(which, minlength=3) / n
    assert np.abs(share - WEIGHTS).max() < 0.01, share
    assert [train.locate(g)[0] for g in range(n)] == which.tolist()
    # every token is the token of its corpus's .bin at that position (-1: an inserted EOD)
    for k, ds in enumerate(train.datasets):
        rows = which == k
        p, t = pos[rows], toks[rows]
        real = p >= 0
        np.testing.assert_array_equal(ds.indexed.tokens[p[real] - train.offsets[k]], t[real])
        assert (t[~real] == train.eod_id).all()
        assert (~real).any() == (k == 2)  # only the corpus preprocessed without --append-eod needs inserted EODs
    # a second build reads exactly the same stream
    again, _ = _build(corpora)
    toks2 = torch.cat([b.tokens for _, b in zip(range(n // 50), iterate_batches(again, 50))]).numpy()
    np.testing.assert_array_equal(toks, toks2)


@pytest.mark.parametrize("dp", [1, 2])
def test_blend_resume_reads_what_the_uninterrupted_run_read(corpora, dp):
    train, _ = _build(corpora)
    mb, steps = 4, 400  # 1600 samples per rank: several epochs of every corpus
    full = [[b.tokens for _, b in zip(range(steps), iterate_batches(train, mb, r, dp))] for r in range(dp)]
    for cut in (1, 97, steps - 3):
        fresh, _ = _build(corpora)  # a restarted process: nothing of the old index survives
        for r in range(dp):
            resumed = iterate_batches(fresh, mb, r, dp, start_sample=cut * mb * dp)
            got = [b.tokens for _, b in zip(range(steps - cut), resumed)]
            assert torch.equal(torch.stack(full[r][cut:]), torch.stack(got))


def test_blend_validation_is_disjoint_from_training(corpora):
    train, valid = _build(corpora)
    assert not valid.datasets[0].shuffle and train.datasets[0].shuffle
    seen = {"train": [set(), set(), set()], "valid": [set(), set(), set()]}
    for name, ds, n in (("train", train, 3000), ("valid", valid, 600)):
        counts = np.zeros(3)
        for g in range(n):
            pos = ds.global_positions(g)
            k = _corpus_of(ds, pos)
            counts[k] += 1
            indexed = ds.datasets[k].indexed
            real = pos[pos >= 0] - ds.offsets[k]
            seen[name][k] |= set((np.searchsorted(indexed.doc_starts, real, side="right") - 1).tolist())
        assert np.abs(counts / n - WEIGHTS).max() < 0.01
    for k in range(3):
        assert seen["train"][k] and seen["valid"][k]
        assert not seen["train"][k] & seen["valid"][k], f"corpus {k}: a document in both splits"
        assert seen["valid"][k] == set(valid.datasets[k].doc_ids.tolist())


def test_blend_of_one_is_the_single_prefix_path(corpora):
    one = DataConfig(blend=[corpora["prefixes"][1]], tokenizer=corpora["tok"], valid_fraction=0.1, seed=5)
    single = DataConfig(prefix=corpora["prefixes"][1], tokenizer=corpora["tok"], valid_fraction=0.1, seed=5)
    (bt, bv, _), (st, sv, _) = build_datasets(one, SEQ), build_datasets(single, SEQ)
    assert isinstance(st, PackedDataset)
    for b, s in ((bt, st), (bv, sv)):
        for g in range(0, 500, 7):
            assert torch.equal(b.global_sample(g), s.global_sample(g))
            np.testing.assert_array_equal(b.global_positions(g), s.global_positions(g))


# ---------------------------------------------------------------- config forms and errors


def test_blend_config_forms():
    from megasparse.config import load_config

    pairs = [(0.3, "/d/a"), (0.7, "/d/b")]
    assert load_config(None, ["data.blend=[0.3, /d/a, 0.7, /d/b]"]).data.blend_entries() == pairs
    assert load_config(None, ["data.blend=0.3 /d/a 0.7 /d/b"]).data.blend_entries() == pairs
    assert DataConfig(blend=["/d/a", "/d/b"]).blend_entries() == [(1.0, "/d/a"), (1.0, "/d/b")]
    assert DataConfig(blend=["/d/a", "/d/b", "/d/c"]).blend_entries()[2] == (1.0, "/d/c")
    DataConfig(blend=["1", "/d/a"], ref_losses=["/s/a"]).validate()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"blend": ["0.3", "/d/a"], "prefix": "/d/x"}, "data.prefix=/d/x and data.blend are mutually exclusive"),
        ({"blend": ["0.3", "/d/a"], "prefix": "synthetic"}, "mutually exclusive"),
        ({"blend": ["0.3", "/d/a", "/d/b", "0.7"]}, "must alternate"),
        ({"blend": ["/d/a", "0.5", "/d/b"]}, "must alternate"),
        ({"blend": ["-1", "/d/a"]}, "must be a positive number"),
        ({"blend": []}, "data.blend"),
        ({"blend": ["0.3", "/d/a", "0.7", "/d/b"], "ref_losses": "/s/a"}, "list of 2 sidecars"),
        ({"blend": ["0.3", "/d/a", "0.7", "/d/b"], "ref_losses": ["/s/a"]}, "list of 2 sidecars"),
        ({"ref_losses": ["/s/a"]}, "a list is for data.blend"),
    ],
)
def test_blend_config_errors_are_one_line(kw, needle):
    with pytest.raises(ConfigError) as e:
        DataConfig(**kw).validate()
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def test_blend_missing_corpus_names_it(corpora):
    cfg = DataConfig(blend=[*corpora["blend"][:2], 0.5, "/nope/x_text_document"], tokenizer=corpora["tok"])
    with pytest.raises(ConfigError, match="/nope/x_text_document.idx does not exist"):
        build_datasets(cfg, SEQ)


# ---------------------------------------------------------------- reference losses: one sidecar per corpus


def test_blend_sidecars_line_up_with_the_blended_positions(corpora):
    from megasparse.filtering.config import FilterConfig
    from megasparse.filtering.reference import ReferenceLosses
    from megasparse.filtering.sidecar import SidecarError, open_sidecar

    train, _ = _build(corpora, ref_losses=corpora["sidecars"])
    ref = ReferenceLosses.from_config(FilterConfig(mode="collider"), corpora["sidecars"], train.prefixes)
    batch = next(iterate_batches(train, 8, start_sample=80))
    got = ref(batch.ids, batch.labels, batch.label_positions)
    for row in range(8):
        pos = batch.positions[row, 1:].numpy()
        k = _corpus_of(train, pos)
        own = open_sidecar(corpora["sidecars"][k], corpora["prefixes"][k])
        want = np.where(pos >= 0, own[np.maximum(pos - train.offsets[k], 0)], 0.0)
        np.testing.assert_array_equal(got[:, row].numpy(), want.astype(np.float32))
    swapped = [corpora["sidecars"][1], corpora["sidecars"][0], corpora["sidecars"][2]]
    with pytest.raises(SidecarError, match="does not match|has .* token losses"):
        ReferenceLosses.from_config(FilterConfig(mode="collider"), swapped, train.prefixes)


# ---------------------------------------------------------------- `megasparse train` on a blend


def test_train_cli_on_a_blend_with_sidecars(corpora, tmp_path):
    out = tmp_path / "run"
    blend = "[" + ", ".join(str(x) for x in corpora["blend"]) + "]"
    cmd = [
        sys.executable, "-m", "megasparse", "train", str(REPO / "configs" / "cpu_toy.yaml"),
        "parallel.tp=1", "train.steps=3", f"data.blend={blend}", f"data.tokenizer={corpora['tok']}",
        "data.valid_fraction=0.1", f"data.ref_losses=[{', '.join(corpora['sidecars'])}]",
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=64", f"model.seq_length={SEQ}", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.eval_interval=3", "train.eval_batches=1", "optim.warmup_steps=1",
        "filter.mode=collider", "filter.reference=sidecar", "filter.keep_ratio=0.5",
        f"logging.out_dir={out}", "logging.log_interval=1", "checkpoint.save_at_end=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "step" in r and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in steps) and np.isfinite(steps[-1]["val_loss"])
