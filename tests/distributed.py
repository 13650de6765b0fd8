"""Run a function on N real gloo ranks (torch.multiprocessing) and collect each rank's return value."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")


def _worker(rank: int, world: int, port: int, outdir: str, fn, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - shipped back to the test
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
    finally:
        from megasparse.parallel import state

        try:
            state.destroy()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(fn, world: int, *args) -> list:
    """``fn(*args)`` on ``world`` ranks; returns the per-rank results or raises with the first traceback."""
    with tempfile.TemporaryDirectory() as d:
        if world == 1:  # in this process: put its environment back, so later subprocesses do not inherit a port
            saved = {k: os.environ.get(k) for k in _RANK_ENV}
            try:
                _worker(0, 1, free_port(), d, fn, args)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        else:
            mp.start_processes(
                _worker, args=(world, free_port(), d, fn, args), nprocs=world, join=True, start_method="spawn"
            )
        out = []
        for r in range(world):
            res = torch.load(os.path.join(d, f"{r}.pt"), weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            out.append(res["ok"])
        return out
