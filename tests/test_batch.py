"""The trainer's one batch iterator: Batch tokens, sample ids and `.bin` offsets agree with the dataset."""

from __future__ import annotations

import numpy as np
import torch

from megasparse.data.dataset import PackedDataset, SyntheticData, batch_iterator, iterate_batches
from megasparse.data.indexed import IndexedDataset, write_indexed


def _packed(tmp_path) -> PackedDataset:
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 200, size=int(rng.integers(2, 30))) for _ in range(20)]  # no EOD: the packer adds it
    write_indexed(tmp_path / "d", docs)
    return PackedDataset(IndexedDataset(tmp_path / "d"), np.arange(20), seq_length=8, eod_id=0, seed=3)


def test_batches_carry_aligned_offsets(tmp_path) -> None:
    ds = _packed(tmp_path)
    it = iterate_batches(ds, 2, dp_rank=1, dp_size=2, start_sample=4)
    tokens = batch_iterator(ds, 2, 1, 2, 4)
    saw_inserted = False
    for _ in range(ds.num_samples):  # past one epoch: the offsets follow the next epoch's order too
        b, t = next(it), next(tokens)
        assert torch.equal(b.tokens, t)  # batch_iterator is the same stream
        assert b.samples.tolist() == [int(b.samples[0]), int(b.samples[0]) + 1]
        for row, g in enumerate(b.samples.tolist()):
            pos = ds.positions(ds.global_index(g))
            assert torch.equal(b.positions[row], torch.from_numpy(pos))
            assert torch.equal(b.tokens[row], ds.global_sample(g))
            real = pos >= 0
            assert np.array_equal(ds.indexed.tokens[pos[real]], b.tokens[row].numpy()[real])
            saw_inserted |= bool((~real).any())
        assert torch.equal(b.label_positions, b.positions[:, 1:].t())
        assert torch.equal(b.labels, b.tokens[:, 1:].t()) and b.targets.shape == (2 * 8,)
    assert saw_inserted
    first = next(iterate_batches(ds, 2, dp_rank=1, dp_size=2, start_sample=4))
    assert first.samples.tolist() == [6, 7]  # round 0 of rank 1 after 4 consumed samples


def test_synthetic_batches_have_no_offsets() -> None:
    ds = SyntheticData(50, 8, seed=1)
    b = next(iterate_batches(ds, 3))
    assert b.positions is None and b.label_positions is None
    assert torch.equal(b.tokens[2], ds.global_sample(2)) and b.ids.is_contiguous() and b.ids.shape == (8, 3)
