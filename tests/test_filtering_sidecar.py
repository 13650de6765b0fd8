"""Reference-loss sidecar: round trip, gather by offset, refusal of sidecars from another dataset build,
alignment with packed samples through the trainer's ReferenceLosses entry point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megasparse.configbase import ConfigError
from megasparse.data.indexed import write_indexed
from megasparse.filtering.config import FilterConfig
from megasparse.filtering.reference import ReferenceLosses
from megasparse.filtering.sidecar import SidecarError, gather_ref_losses, open_sidecar, write_sidecar


def _docs(seed: int, n_docs: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=int(rng.integers(3, 40))) for _ in range(n_docs)]


def _with_sidecar(tmp_path, seed: int, dtype: str = "float16") -> tuple[str, list[np.ndarray], int]:
    """(prefix, documents, token count) of a fresh dataset with a zero sidecar at tmp_path / "s"."""
    prefix, docs = str(tmp_path / "ds"), _docs(seed)
    write_indexed(prefix, docs)
    n = sum(len(d) for d in docs)
    write_sidecar(tmp_path / "s", prefix, np.zeros(n), dtype=dtype)
    return prefix, docs, n


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 2e-3)])
def test_round_trip_and_gather(tmp_path, dtype: str, tol: float) -> None:
    prefix = tmp_path / "ds"
    docs = _docs(0)
    write_indexed(prefix, docs)
    n = sum(len(d) for d in docs)
    losses = np.random.default_rng(1).random(n).astype(np.float32) * 10
    side = tmp_path / "ds.refloss"
    # chunks in token order are accepted as well as one array
    write_sidecar(side, prefix, [losses[:7], torch.from_numpy(losses[7:])], dtype=dtype)
    arr = open_sidecar(side, prefix)
    assert arr.shape == (n,) and arr.dtype == np.dtype(dtype)
    np.testing.assert_allclose(arr.astype(np.float32), losses, rtol=tol, atol=0)
    offsets = torch.tensor([[0, 5], [n - 1, 3], [2, 2]])
    got = gather_ref_losses(arr, offsets)
    assert got.shape == offsets.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.from_numpy(losses[offsets.numpy()]), rtol=tol, atol=0)
    with pytest.raises(IndexError, match="outside"):
        gather_ref_losses(arr, torch.tensor([n]))
    # -1: a token the packer inserted (not in .bin) gets the fill value
    got = gather_ref_losses(arr, torch.tensor([3, -1, 4]), fill=-7.0)
    assert got[1] == -7.0 and got[0] == float(arr[3]) and got[2] == float(arr[4])


def test_refuses_token_count_mismatch(tmp_path) -> None:
    prefix, docs, n = _with_sidecar(tmp_path, 2)
    write_indexed(prefix, docs + [np.arange(4)])  # dataset rebuilt with one more document
    with pytest.raises(SidecarError) as e:
        open_sidecar(tmp_path / "s", prefix)
    msg = str(e.value)
    assert "\n" not in msg and f"{n} token losses" in msg and f"{n + 4} tokens" in msg and "ref score" in msg
    with pytest.raises(SidecarError, match=f"got {n - 1} losses"):
        write_sidecar(tmp_path / "s2", prefix, np.ones(n - 1))
    with pytest.raises(SidecarError, match=f"got {n + 6} losses"):
        write_sidecar(tmp_path / "s2", prefix, [np.ones(n + 4), np.ones(2)])
    assert not (tmp_path / "s2").exists()


def test_refuses_fingerprint_mismatch(tmp_path) -> None:
    prefix, docs, _ = _with_sidecar(tmp_path, 3)
    open_sidecar(tmp_path / "s", prefix)
    # same tokens, same count, different document boundaries: only the fingerprint can tell
    flat = np.concatenate(docs)
    write_indexed(prefix, [flat[:10], flat[10:]])
    with pytest.raises(SidecarError, match="fingerprint .* does not match .*re-run"):
        open_sidecar(tmp_path / "s", prefix)


def test_refuses_broken_files(tmp_path) -> None:
    prefix, _, _ = _with_sidecar(tmp_path, 4, dtype="float32")
    with pytest.raises(SidecarError, match="does not exist"):
        open_sidecar(tmp_path / "missing", prefix)
    (tmp_path / "junk").write_bytes(b"x" * 100)
    with pytest.raises(SidecarError, match="bad header"):
        open_sidecar(tmp_path / "junk", prefix)
    data = (tmp_path / "s").read_bytes()
    (tmp_path / "s").write_bytes(data[:-4])
    with pytest.raises(SidecarError, match="truncated"):
        open_sidecar(tmp_path / "s", prefix)


def test_gather_aligns_with_packed_samples(tmp_path) -> None:
    """Sidecar values gathered at a packed sample's label positions equal the reference scored on the sample."""
    from megasparse.data.dataset import PackedDataset
    from megasparse.data.indexed import IndexedDataset
    from megasparse.filtering.ngram import NgramLM

    eod = 0
    rng = np.random.default_rng(6)
    docs = [np.append(rng.integers(1, 30, size=int(rng.integers(4, 25))), eod) for _ in range(12)]
    prefix = tmp_path / "ds"
    write_indexed(prefix, docs)
    ds = IndexedDataset(prefix)
    # a bigram's context is one token, so scoring a sample alone loses nothing but across document starts
    lm = NgramLM.fit(np.asarray(ds.tokens), 30, order=2, eod_id=eod, doc_starts=ds.doc_starts)
    write_sidecar(tmp_path / "s", prefix, lm.stream_losses(np.asarray(ds.tokens), doc_starts=ds.doc_starts), "float32")
    side = open_sidecar(tmp_path / "s", prefix)
    lm.save(tmp_path / "lm.npz")
    # the trainer's entry point, both sources
    from_sidecar = ReferenceLosses.from_config(FilterConfig(reference="sidecar"), str(tmp_path / "s"), str(prefix))
    from_ngram = ReferenceLosses.from_config(
        FilterConfig(reference="ngram", ngram_path=str(tmp_path / "lm.npz")), None, None
    )
    packed = PackedDataset(ds, np.arange(1, 12, 2), seq_length=16, eod_id=eod, shuffle=False)
    for i in range(len(packed)):
        sample = packed[i]
        pos = torch.from_numpy(packed.positions(i))
        got = gather_ref_losses(side, pos[1:].reshape(-1, 1))
        tokens, labels = sample[:-1].reshape(-1, 1), sample[1:].reshape(-1, 1)
        expect = lm.label_losses(tokens, labels)
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(from_sidecar(tokens, labels, pos[1:].reshape(-1, 1)), expect, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(from_ngram(tokens, labels), expect, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="data.ref_losses"):
        ReferenceLosses.from_config(FilterConfig(reference="sidecar"), None, str(prefix))
    with pytest.raises(ConfigError, match="ngram_path"):
        ReferenceLosses.from_config(FilterConfig(reference="ngram"), None, None)
