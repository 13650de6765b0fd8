"""Vocabulary-parallel loss over real gloo groups (TP=2, 4) equals the single-process loss."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megasparse.loss import LossConfig, vocab_parallel_loss
from megasparse.parallel import comm
from megasparse.parallel.vocab import vocab_range

N, V, D = 24, 101, 20  # V not divisible by 2 or 4: the last shard carries padding


def _data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5 * 3
    t = torch.randint(0, V, (N,), generator=g)
    t[[1, 7, 20]] = -100
    gout = torch.rand(N, generator=g) + 0.5
    keep = torch.tensor([0, 1, 2, 5, 9, 10, 11, 19, 23])  # unbalanced over SP shards on purpose
    return h, w, t, gout, keep


def _run(h, w, t, gout, cfg, **kw):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = vocab_parallel_loss(hh, ww, t, cfg, **kw)
    loss.backward(gout)
    return loss.detach(), hh.grad, ww.grad


def _worker(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h, w, t, gout, keep = _data()
        solo = [dist.new_group([r]) for r in range(world)][rank]  # a one-rank group: the TP=1 reference
        start, per, padded = vocab_range(V, None)
        w_pad = torch.cat([w, torch.full((padded - V, D), 50.0)])  # padding must not leak into the lse
        shard = w_pad[start : start + per]
        checked = 0
        for impl in ("cce", "materialized"):
            for sp in (False, True):
                for k in (None, keep):
                    cfg = LossConfig(impl=impl, filter_eps=None, sort_vocab=impl == "cce", z_loss=1e-3)
                    ref = _run(h, w, t, gout, cfg, vocab_start=0, vocab_size=V, tp_group=solo, keep_idx=k)
                    rows = slice(rank * N // world, (rank + 1) * N // world) if sp else slice(None)
                    rec = comm.CommRecorder()
                    with comm.recording(rec):
                        loss, dh, dw = _run(h[rows], shard, t, gout, cfg, vocab_start=start, vocab_size=V,
                                            tp_group=None, sequence_parallel=sp, keep_idx=k)  # fmt: skip
                    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(dh, ref[1][rows], rtol=1e-5, atol=1e-6)
                    n_real = max(0, min(per, V - start))
                    torch.testing.assert_close(dw[:n_real], ref[2][start : start + n_real], rtol=1e-5, atol=1e-6)
                    assert torch.all(dw[n_real:] == 0)
                    if impl == "cce":
                        # forward: one [2, valid rows] fp32 all-gather (+ SP hidden gather); backward: kept rows only
                        fwd = [r for r in rec.records if r.kind == "all_gather" and r.numel != N // world * D]
                        assert len(fwd) == 1 and fwd[0].numel == 2 * (N - 3), rec.records
                        assert all(r.phase == "backward" for r in rec.records if r.kind != "all_gather")
                        if k is not None:
                            bwd = [r for r in rec.records if r.kind in ("all_reduce", "reduce_scatter")]
                            kept_valid = len(set(k.tolist()) - {1, 7, 20})
                            assert len(bwd) == 1 and bwd[0].numel <= kept_valid * D * world, bwd
                            assert bwd[0].numel < N * D
                    checked += 1
        # SP: hidden rows × TP that do not cover the targets fail in one line naming both, before any collective
        try:
            vocab_parallel_loss(h[:5], shard, t, LossConfig(impl="cce"), vocab_start=start, vocab_size=V,
                                tp_group=None, sequence_parallel=True)  # fmt: skip
            checked = -1
        except ValueError as e:
            if f"5 hidden rows × tp {world} (sequence parallel) = {5 * world} rows but {N} targets" != str(e)[6:]:
                raise
        q.put((rank, checked, None))
    except Exception:  # report to the parent instead of hanging it
        import traceback

        q.put((rank, 0, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_equals_single_process(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    for rank, checked, err in results:
        assert err is None, f"rank {rank}:\n{err}"
        assert checked == 8


def _compact_ignored_worker(impl: str) -> dict:
    """TP=2 + SP, the trainer's filtered backward: kept rows (a KeepHolder filled after the forward) include rows
    whose label is ignore_index; the compact dE of this rank's kept rows against the fp64 single-process loss."""
    from megasparse.ops.compact import CompactGrad, KeepHolder, KeepMeta
    from megasparse.parallel import state

    lay = state.init(tp=2, pp=1, sequence_parallel=True, backend="gloo")
    h, w, t, gout, keep = _data()
    t[19] = -100  # kept rows 1 (shard 0) and 19 (shard 1) now have ignored targets
    start, per, padded = vocab_range(V, state.tp_group())
    w_pad = torch.cat([w, torch.zeros(padded - V, D)])
    rows = slice(lay.tp_rank * N // 2, (lay.tp_rank + 1) * N // 2)
    hh = h[rows].clone().requires_grad_()
    holder = KeepHolder()
    cfg = LossConfig(impl=impl, filter_eps=None, backend="reference" if impl == "cce" else None)
    loss = vocab_parallel_loss(hh, w_pad[start : start + per], t, cfg, vocab_start=start, vocab_size=V,
                               tp_group=state.tp_group(), sequence_parallel=True, keep_idx=holder)  # fmt: skip
    holder.meta = KeepMeta(keep, N)
    got = {}
    hh.register_hook(lambda g: got.setdefault("g", g))
    loss.backward(gout)
    g = got["g"]
    assert isinstance(g, CompactGrad)
    mask = torch.zeros(N, dtype=torch.float64)
    mask[keep] = 1
    h64, w64 = h.double().requires_grad_(), w.double()
    lg = h64 @ w64.T
    valid = t != -100
    ref = torch.where(valid, torch.logsumexp(lg, 1) - lg.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ref.backward(gout.double() * mask)
    local = h64.grad[rows]
    return {"rows": g.rows, "idx": g.meta.idx, "ref": local[g.meta.idx], "ignored": (t[rows] == -100)[g.meta.idx]}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cce", "materialized"])
def test_tp2_sp_compact_kept_rows_with_ignored_targets(impl):
    from distributed import run_distributed

    res = run_distributed(_compact_ignored_worker, 2, impl)
    assert [int(r["ignored"].sum()) for r in res] == [1, 1]  # one kept row with an ignored target per shard
    for r in res:
        assert torch.all(r["rows"][r["ignored"]] == 0)
        torch.testing.assert_close(r["rows"].double(), r["ref"], rtol=1e-5, atol=1e-6)
