"""Blend-index build time: megasparse's C loop and numpy build vs megatron-core's C++ ``build_blending_indices``.

    python benchmarks/bench_blend_index.py [--samples 10000000] [--weights 0.3 0.5 0.2 | --random K]
                                           [--repeats 5] [--json out.json]

Times on the CPU, best of ``--repeats`` interleaved rounds (the machine may be shared), for ``--samples`` samples:

- ``megatron-core C++``: ``helpers.build_blending_indices`` (the compiled ``helpers_cpp`` megatron-core ships, or
  built with ``megatron.core.datasets.utils.compile_helpers()``), output arrays allocated as megatron does;
- ``megasparse C``: ``blend_indices(backend="c")``, the loop ``blend_kernel.py`` compiles on first use (default);
- ``megasparse numpy``: ``blend_indices(backend="numpy")``, the fallback without a C compiler (chunks side by side);
- ``pure python loop``: the greedy as a plain loop, timed on ``--python-samples`` and scaled to ``--samples``.

Every megasparse result is checked equal to megatron-core's first. ``--random K`` draws K weights from a
Dirichlet(0.5) (seed 0): many corpora, some tiny. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings

import numpy as np

from megasparse.data.blend import blend_indices, normalize_weights


def megatron_helpers():
    """megatron-core's compiled helpers, compiling them once if the wheel came without; None if impossible."""
    warnings.filterwarnings("ignore")
    try:
        from megatron.core.datasets import helpers

        return helpers
    except ImportError:
        pass
    try:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
        from megatron.core.datasets import helpers

        return helpers
    except (ImportError, SystemExit):
        return None


def python_loop(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy in plain Python."""
    counts = [0] * len(w)
    wl = w.tolist()
    di, dsi = np.zeros(n, np.int16), np.zeros(n, np.int64)
    for i in range(n):
        x = max(float(i), 1.0)
        best, arg = wl[0] * x - counts[0], 0
        for k in range(1, len(wl)):
            e = wl[k] * x - counts[k]
            if e > best:
                best, arg = e, k
        di[i], dsi[i] = arg, counts[arg]
        counts[arg] += 1
    return di, dsi


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.5, 0.2])
    ap.add_argument("--random", type=int, default=0, help="K Dirichlet(0.5) weights instead of --weights")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python-samples", type=int, default=300_000)
    ap.add_argument("--skip-numpy", action="store_true", help="leave out the numpy build (slow with many corpora)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    n = a.samples
    w = normalize_weights(np.random.default_rng(0).dirichlet(np.full(a.random, 0.5)) if a.random else a.weights)
    helpers = megatron_helpers()
    builders = {"megasparse C": lambda: blend_indices(w, n, backend="c")}
    if not a.skip_numpy:
        builders["megasparse numpy"] = lambda: blend_indices(w, n, backend="numpy")
    if helpers is not None:

        def mc() -> tuple[np.ndarray, np.ndarray]:
            di, dsi = np.zeros(n, np.int16), np.zeros(n, np.int64)
            helpers.build_blending_indices(di, dsi, w, len(w), n, False)
            return di, dsi

        ref_di, ref_dsi = mc()
        for name, fn in builders.items():
            di, dsi, _ = fn()
            if not (np.array_equal(di, ref_di) and np.array_equal(dsi, ref_dsi)):
                print(f"{name}: the blend index differs from megatron-core's", file=sys.stderr)
                return 1
        del ref_di, ref_dsi, di, dsi
        builders = {"megatron-core C++": mc, **builders}
    else:
        print("megatron-core's C++ helpers are unavailable: only megasparse is timed", file=sys.stderr)
    rows = {name: min(timed(fn) for _ in range(1)) for name, fn in builders.items()}
    for _ in range(a.repeats - 1):  # interleaved, so a busy moment of a shared machine hits all builders alike
        for name, fn in builders.items():
            rows[name] = min(rows[name], timed(fn))
    m = min(a.python_samples, n)
    check = python_loop(w, 2000)
    got = blend_indices(w, 2000)
    assert np.array_equal(check[0], got[0]) and np.array_equal(check[1], got[1])
    rows["pure python loop (scaled)"] = timed(lambda: python_loop(w, m)) * n / m
    ref = rows.get("megatron-core C++")
    print(f"\nblend index, {n:,} samples, {len(w)} datasets (smallest weight {w.min():.2e}), best of {a.repeats}")
    print(f"{'builder':<28} {'seconds':>8} {'vs megatron-core':>17}")
    for name, t in rows.items():
        print(f"{name:<28} {t:>8.3f} {(f'{t / ref:.2f}x' if ref else '-'):>17}")
    if a.json:
        doc = {
            "samples": n,
            "weights": w.tolist(),
            "repeats": a.repeats,
            "seconds": rows,
            "machine": f"{platform.processor() or platform.machine()}, numpy {np.__version__}",
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
