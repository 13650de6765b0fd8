"""Kneser-Ney n-gram reference: agreement with a dict-based implementation, normalisation, domain, persistence."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.filtering.ngram import NgramLM


def _markov(n: int, vocab: int, seed: int, branching: int = 3, eod: int | None = None) -> np.ndarray:
    """Tokens from a sparse random Markov chain (each token has ``branching`` successors)."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=(vocab, branching))
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    pick = rng.integers(0, branching, size=n)
    for i in range(1, n):
        out[i] = succ[out[i - 1], pick[i]]
        if eod is not None and rng.random() < 0.02:
            out[i] = eod
    return out


class _DictKN:
    """Interpolated modified Kneser-Ney written directly from the definitions, with Python dicts."""

    def __init__(self, docs: list[list[int]], vocab: int, order: int) -> None:
        self.V, self.N, bos = vocab, order, vocab
        raw: dict[tuple, int] = defaultdict(int)
        for d in docs:
            pad = [bos] * (order - 1) + list(d)
            for i in range(order - 1, len(pad)):
                raw[tuple(pad[i - order + 1 : i + 1])] += 1
        self.adj = {order: dict(raw)}
        for n in range(order - 1, 0, -1):
            a: dict[tuple, int] = defaultdict(int)
            for g, c in self.adj[n + 1].items():
                # left extensions of a BOS-started n-gram are all BOS: keep its raw count
                a[g[1:]] += c if g[1] == bos else 1
            self.adj[n] = dict(a)
        self.disc = {n: self._discounts(list(self.adj[n].values())) for n in self.adj}
        self.by_ctx: dict[int, dict[tuple, dict[int, int]]] = {}
        for n, grams in self.adj.items():
            ctx: dict[tuple, dict[int, int]] = defaultdict(dict)
            for g, c in grams.items():
                ctx[g[:-1]][g[-1]] = c
            self.by_ctx[n] = ctx

    @staticmethod
    def _discounts(counts: list[int]) -> list[float]:
        n = [sum(1 for c in counts if c == k) for k in (1, 2, 3, 4)]
        if min(n) == 0:
            return [0.75] * 3
        y = n[0] / (n[0] + 2 * n[1])
        return [min(max(k - (k + 1) * y * n[k] / n[k - 1], 0.05), k) for k in (1, 2, 3)]

    def prob(self, ctx: tuple, w: int, n: int | None = None) -> float:
        n = self.N if n is None else n
        lower = 1.0 / self.V if n == 0 else None
        if n == 0:
            return lower
        h = tuple(ctx[len(ctx) - (n - 1) :]) if n > 1 else ()
        lower = self.prob(ctx, w, n - 1)
        words = self.by_ctx[n].get(h)
        if not words:
            return lower
        d = self.disc[n]
        total = sum(words.values())
        gamma = sum(d[min(c, 3) - 1] for c in words.values()) / total
        c = words.get(w, 0)
        alpha = max(c - d[min(c, 3) - 1], 0.0) / total if c else 0.0
        return alpha + gamma * lower


def _random_contexts(rng: np.random.Generator, m: int, order: int, vocab: int) -> np.ndarray:
    ctx = rng.integers(0, vocab, size=(m, order - 1))
    for row in ctx:
        row[: rng.integers(0, order)] = vocab  # a leading run of BOS: the start of a document
    return ctx


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_matches_dict_implementation(order: int) -> None:
    vocab, eod = 13, 12
    toks = _markov(600, vocab, seed=order, eod=eod)
    docs, cur = [], []
    for t in toks:
        cur.append(int(t))
        if t == eod:
            docs.append(cur)
            cur = []
    docs.append(cur)
    lm = NgramLM.fit(torch.from_numpy(toks), vocab, order=order, eod_id=eod)
    ref = _DictKN(docs, vocab, order)
    rng = np.random.default_rng(0)
    ctx = _random_contexts(rng, 200, order, vocab)
    words = rng.integers(0, vocab, size=200)
    ours = lm.prob(ctx, words)
    theirs = np.array([ref.prob(tuple(c), int(w)) for c, w in zip(ctx, words)])
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_distribution_sums_to_one(order: int) -> None:
    vocab = 40
    lm = NgramLM.fit(_markov(5000, vocab, seed=1), vocab, order=order)
    rng = np.random.default_rng(order)
    for c in list(_random_contexts(rng, 25, order, vocab)) + [[], [3], list(range(order - 1))]:
        c = [int(x) for x in c if x != vocab]  # distribution() pads short contexts with BOS itself
        p = lm.distribution(c)
        assert p.shape == (vocab,) and (p > 0).all()
        assert abs(p.sum() - 1.0) < 1e-9


def test_in_domain_beats_shuffled_and_unigram() -> None:
    vocab = 200
    toks = _markov(60_000, vocab, seed=5)
    lm = NgramLM.fit(toks[:50_000], vocab, order=3)
    held = torch.from_numpy(toks[50_000:]).reshape(10, -1).t()  # [s, b]: each column a run of held-out text
    shuffled = held.reshape(-1)[torch.randperm(held.numel(), generator=torch.Generator().manual_seed(0))]
    in_domain = lm.token_losses(held).mean().item()
    off_domain = lm.token_losses(shuffled.reshape(held.shape)).mean().item()
    assert in_domain < np.log(3) + 0.2  # the chain's entropy is at most log(3)
    assert off_domain > in_domain + 2.0
    assert in_domain < NgramLM.fit(toks[:50_000], vocab, order=1).token_losses(held).mean().item() - 1.0


def test_token_losses_layout_documents_and_labels() -> None:
    vocab, eod = 30, 29
    lm = NgramLM.fit(_markov(8000, vocab, seed=2, eod=eod), vocab, order=3, eod_id=eod)
    a = torch.tensor([5, 6, 7, eod, 8, 9, 10, 11])
    b = torch.tensor([8, 9, 10, 11, 1, 2, 3, 4])
    out = lm.token_losses(torch.stack([a, b], dim=1))
    assert out.shape == (8, 2) and out.dtype == torch.float32
    # each column is its own stream, and the eod in column 0 starts a new document
    assert torch.equal(out[:, 0], lm.token_losses(a))
    torch.testing.assert_close(out[4:, 0], out[:4, 1], rtol=0, atol=0)
    expect = -np.log(lm.prob(np.array([[vocab, 5], [5, 6]]), np.array([6, 7])))
    torch.testing.assert_close(out[1:3, 0].double(), torch.from_numpy(expect), rtol=1e-6, atol=0)
    # label alignment: label_losses[t] is the loss of labels[t] = tokens[t + 1]
    tokens, labels = a[:-1].unsqueeze(1), a[1:].unsqueeze(1)
    torch.testing.assert_close(lm.label_losses(tokens, labels), lm.token_losses(a.unsqueeze(1))[1:])


def test_save_load_round_trip(tmp_path) -> None:
    vocab, eod = 50, 0
    lm = NgramLM.fit(_markov(4000, vocab, seed=9, eod=eod), vocab, order=3, eod_id=eod)
    path = tmp_path / "counts.npz"
    lm.save(path)
    back = NgramLM.load(path)
    assert (back.order, back.vocab_size, back.eod_id) == (3, vocab, eod)
    x = torch.from_numpy(_markov(300, vocab, seed=10)).reshape(-1, 3)
    assert torch.equal(back.token_losses(x), lm.token_losses(x))
    no_eod = NgramLM.fit(_markov(100, vocab, seed=9), vocab, order=2)
    no_eod.save(path)
    assert NgramLM.load(path).eod_id is None
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    with pytest.raises(ConfigError, match="ref ngram"):
        NgramLM.load(tmp_path / "junk.npz")


def test_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        NgramLM.fit(np.array([1, 2, 50]), 50)
    with pytest.raises(ConfigError, match="empty"):
        NgramLM.fit(np.array([], dtype=np.int64), 50)
    with pytest.raises(ConfigError, match="--order"):
        NgramLM.fit(np.array([1, 2]), 128_000, order=4)
    lm = NgramLM.fit(np.array([1, 2, 3]), 10)
    with pytest.raises(ConfigError, match="vocab_size"):
        lm.token_losses(torch.tensor([1, 11]))
