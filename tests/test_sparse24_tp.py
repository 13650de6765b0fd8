"""TP=2 sparse SwiGLU FFN (column-parallel fc1, row-parallel fc2, all-reduce through megasparse.parallel.comm)
equals the TP=1 FFN with the same masks: 2 gloo processes against a single-process fp64 reference."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

H, F, N, TP = 16, 24, 12, 2  # F/TP = 12: shard sides stay multiples of 4, so 4x4 blocks never cross shards


def _weights():
    g = torch.Generator().manual_seed(11)
    gate = torch.randn(F, H, dtype=torch.float64, generator=g)
    up = torch.randn(F, H, dtype=torch.float64, generator=g)
    w2 = torch.randn(H, F, dtype=torch.float64, generator=g)
    x = torch.randn(N, H, dtype=torch.float64, generator=g)
    gy = torch.randn(N, H, dtype=torch.float64, generator=g)
    return gate, up, w2, x, gy


def _ffn(x, w1, w2, s1, s2):
    from megasparse.sparse24 import gated_activation, sparse24_linear

    return sparse24_linear(gated_activation(sparse24_linear(x, w1, s1), "swiglu"), w2, s2)


def _reference():
    from megasparse.sparse24 import Sparse24Weight, transposable_mask

    gate, up, w2, x, gy = _weights()
    w1 = torch.nn.Parameter(torch.cat([gate, up]))  # megatron-core chunk order: gate rows, then up rows
    w2 = torch.nn.Parameter(w2)
    x = x.clone().requires_grad_(True)
    s1 = Sparse24Weight(w1, transposable_mask(w1.detach()), backend="emulate", name="fc1")
    s2 = Sparse24Weight(w2, transposable_mask(w2.detach()), backend="emulate", name="fc2")
    y = _ffn(x, w1, w2, s1, s2)
    y.backward(gy)
    return y.detach(), x.grad, w1.grad, w2.grad, s1.mask, s2.mask


def _worker(rank: int, port: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(TP))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    from megasparse.parallel import comm, state
    from megasparse.sparse24 import SparsityManager
    from megasparse.sparse24.config import SparsityConfig

    state.init(tp=TP, pp=1, backend="gloo")
    try:
        gate, up, w2, x, gy = _weights()
        f = F // TP
        rows = slice(rank * f, (rank + 1) * f)
        w1_shard = torch.nn.Parameter(torch.cat([gate[rows], up[rows]]))  # column-parallel fc1 [2f/tp, h]
        w2_shard = torch.nn.Parameter(w2[:, rows].contiguous())  # row-parallel fc2 [h, f/tp]
        mgr = SparsityManager(
            {"fc1": w1_shard, "fc2": w2_shard}, SparsityConfig(enabled=True, backend="emulate"), total_steps=100
        )
        x = x.clone().requires_grad_(True)
        y = _ffn(x, w1_shard, w2_shard, mgr.state("fc1"), mgr.state("fc2"))
        y_sum = y.detach().clone()
        comm.all_reduce(y_sum, state.tp_group(), "tp")  # row-parallel output reduction
        y.backward(gy)
        gx = x.grad.clone()
        comm.all_reduce(gx, state.tp_group(), "tp")  # column-parallel input-gradient reduction
        return {
            "y": y_sum,
            "gx": gx,
            "g1": w1_shard.grad,
            "g2": w2_shard.grad,
            "m1": mgr.masks["fc1"],
            "m2": mgr.masks["fc2"],
        }
    finally:
        state.destroy()


def _run(rank: int, port: int, out_dir: str) -> None:
    torch.save(_worker(rank, port), os.path.join(out_dir, f"rank{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tp2_sparse_ffn_matches_tp1(tmp_path):
    pytest.importorskip("megatron.core")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(_free_port(), str(tmp_path)), nprocs=TP, join=True)
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)}
    y, gx, g1, g2, m1, m2 = _reference()
    f = F // TP
    for rank, res in results.items():
        rows = slice(rank * f, (rank + 1) * f)
        # masks computed on each shard equal the full-matrix mask's slices
        assert torch.equal(res["m1"], torch.cat([m1[:F][rows], m1[F:][rows]]))
        assert torch.equal(res["m2"], m2[:, rows])
        torch.testing.assert_close(res["y"], y, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(res["gx"], gx, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(res["g1"], torch.cat([g1[:F][rows], g1[F:][rows]]), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(res["g2"], g2[:, rows], rtol=1e-10, atol=1e-10)
