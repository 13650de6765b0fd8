"""The 2:4 masked decay's device time at one pipeline stage's FFN weights, as it ran and as it runs now (decision 1236).

    python benchmarks/bench_masked_decay.py [--layers 16] [--hidden 4096] [--ffn 14336] [--dp 2] [--reps 20]

Three ways over the same fp32 gradients, bf16 weights and bool masks (fc1 [2·ffn, hidden] and fc2 [hidden, ffn] per
layer; the defaults are the whole Llama-3-8B's PP2 stage: 16 layers, 2.8e9 weights):
- ``addcmul, whole``: the path before, ``g.addcmul_(W, ~M)`` over every whole gradient (what each DP rank did under
  the distributed optimizer);
- ``triton, whole``: ``sparse24.decay.masked_decay_`` over whole gradients (the replicated, non-fused path now);
- ``triton, owned 1/dp``: the same over a 1/dp slice of each (the distributed optimizer's path now; a rank's owned
  ranges add up to 1/dp of the stage's weights).
Prints milliseconds (CUDA events, median over ``--reps``), bytes moved per step and the rate, and how many decayed
values the Triton pass and ``addcmul_`` round differently (a CUDA ``addcmul_`` may fuse the multiply into the add);
writes the same to ``--out`` (default ``docs/benchmarks/data/masked_decay_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megasparse.sparse24.decay import masked_decay_  # noqa: E402

LAMBDA = 2e-4
DATA = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "data"


def _time(fn, reps: int, dev: torch.device) -> float:
    """Median milliseconds of ``fn`` (CUDA events; the host clock on a CPU smoke run)."""
    fn()
    times = []
    for _ in range(reps):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (times mean nothing)")
    p.add_argument("--out", default=None, help="JSON file (default on CUDA: docs/benchmarks/data/...)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    shapes = [(2 * a.ffn, a.hidden), (a.hidden, a.ffn)] * a.layers
    gs = [torch.randn(s, device=dev) for s in shapes]
    ws = [torch.randn(s, device=dev).bfloat16() for s in shapes]
    ms = [torch.rand(s, device=dev) < 0.5 for s in shapes]
    n = sum(g.numel() for g in gs)

    def addcmul() -> None:
        for g, w, m in zip(gs, ws, ms):
            g.addcmul_(w, ~m, value=LAMBDA)

    def triton_whole() -> None:
        for g, w, m in zip(gs, ws, ms):
            masked_decay_(g, w, m, LAMBDA)

    def triton_owned() -> None:
        for g, w, m in zip(gs, ws, ms):
            k = g.numel() // a.dp
            masked_decay_(g.view(-1)[:k], w.view(-1)[:k], m.view(-1)[:k], LAMBDA)

    rows = [  # bytes per decayed element: ~M (read M, write ~M) + addcmul (g, W, ~M in, g out); Triton: g, W, M, g
        ("addcmul, whole", addcmul, 13 * n),
        ("triton, whole", triton_whole, 11 * n),
        (f"triton, owned 1/{a.dp}", triton_owned, 11 * n // a.dp),
    ]
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{where}: {n / 1e9:.2f}e9 weights in {len(shapes)} tensors, W bf16, g fp32")
    out = {"device": where, "torch": torch.__version__, "weights": n, "args": vars(a), "rows": []}
    for name, fn, nbytes in rows:
        t = _time(fn, a.reps, dev)
        print(f"{name:>22}: {t:8.2f} ms  {nbytes / 1e9:6.1f} GB  {nbytes / t / 1e6:6.0f} GB/s")
        out["rows"].append({"path": name, "ms": t, "bytes": nbytes})
    g0 = torch.randn(shapes[0], device=dev)
    ref, got = g0.clone(), g0.clone()
    ref.addcmul_(ws[0], ~ms[0], value=LAMBDA)
    masked_decay_(got, ws[0], ms[0], LAMBDA)
    diff = int((ref != got).sum())
    print(f"rounded differently from addcmul_: {diff} of {g0.numel()} (max |d| {(ref - got).abs().max():.3g})")
    out["rounded_differently"] = diff
    if a.out or dev.type == "cuda":  # a CPU smoke run writes only where it is told to
        tag = where.replace("NVIDIA ", "").split()[0].lower()
        path = Path(a.out) if a.out else DATA / f"masked_decay_{tag}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
