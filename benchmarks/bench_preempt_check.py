"""Cost of the per-step stop-signal agreement (decision 0903): one 1-element MAX all-reduce over the world plus the
host read, as ``Preemption.agreed()`` runs it at every step boundary.

    torchrun --standalone --nproc_per_node 8 benchmarks/bench_preempt_check.py [--iters 2000]
    python benchmarks/bench_preempt_check.py --cpu        # gloo, 1 process (a smoke run)

Prints the mean and p99 microseconds per call on rank 0, and the same for a bare ``torch.cuda.synchronize()``
(what the step already pays at its end) for scale.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megasparse.preempt import Preemption


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = not a.cpu and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    p = Preemption(None, dev)
    world = dist.get_world_size()

    def timed(fn) -> list[float]:
        for _ in range(50):
            fn()
        out = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return sorted(out)

    if world == 1:  # agreed() skips the collective at world size 1: time the collective it would run
        flag = torch.zeros(1, device=dev)
        check = timed(lambda: (dist.all_reduce(flag, op=dist.ReduceOp.MAX), flag.item()))
    else:
        check = timed(p.agreed)
    sync = timed(torch.cuda.synchronize) if cuda else None
    if dist.get_rank() == 0:
        q = lambda xs: f"mean {sum(xs) / len(xs):8.1f} us  p99 {xs[int(0.99 * len(xs))]:8.1f} us"  # noqa: E731
        print(f"world {world} {'nccl' if cuda else 'gloo'}: stop-signal agreement {q(check)}")
        if sync:
            print(f"{'':>{len(str(world)) + 12}}torch.cuda.synchronize {q(sync)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
