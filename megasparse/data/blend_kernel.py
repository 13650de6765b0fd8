"""The blend greedy as a 15-line C loop, compiled on first use with the system C compiler and loaded with ctypes.

Why: the numpy build in ``blend.py`` is exact but pays a few numpy calls per dataset per step, so with tens of
corpora (or a corpus of weight 1e-6, whose miscounted start takes long to wash out) it falls far behind
megatron-core's C++. A loop this small needs no build step at install: the first process that needs it runs
``$CC`` (else ``cc``) once into the megasparse cache directory (``build_once``: safe with many ranks) and every
later process loads the cached library. Without a compiler, or if the compile fails, :func:`load` returns None
and ``blend.py`` uses its numpy build (logged once). ``BlendIndex(backend="numpy")`` forces the numpy build.

``-ffp-contract=off`` keeps ``w * n - c`` two rounded operations (no fused multiply-add), as in megatron's build,
so the output is bit-identical to ``helpers.build_blending_indices`` on every platform.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from megasparse.data.cache import build_once, log, resolve_cache_dir

__all__ = ["SOURCE", "load", "run"]

SOURCE = r"""
#include <stdint.h>
/* Megatron's greedy blend from sample `start` on, given the per-dataset counts before it (updated in place):
   sample n goes to the first k maximising w[k] * max(n, 1) - counts[k]. */
void megasparse_blend(const double *w, int32_t k_count, int64_t start, int64_t size, double *counts,
                      int16_t *dataset_index, int64_t *dataset_sample_index) {
    for (int64_t i = 0; i < size; ++i) {
        double n = (double)(start + i);
        if (n < 1.0) n = 1.0;
        int32_t arg = 0;
        double best = w[0] * n - counts[0];
        for (int32_t k = 1; k < k_count; ++k) {
            double e = w[k] * n - counts[k];
            if (e > best) { best = e; arg = k; }
        }
        dataset_index[i] = (int16_t)arg;
        dataset_sample_index[i] = (int64_t)counts[arg];
        counts[arg] += 1.0;
    }
}
"""
_FLAGS = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def _compile(out: Path, cc: str) -> None:
    (out / "blend.c").write_text(SOURCE)
    res = subprocess.run(
        [cc, *_FLAGS, "-o", str(out / "blend.so"), str(out / "blend.c")], capture_output=True, text=True
    )
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        raise OSError(lines[-1] if lines else f"{cc} exited with {res.returncode}")


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it once per machine and source; None when it cannot be had."""
    global _lib
    if _lib is not False:
        return _lib or None
    _lib = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        log("no C compiler (cc/gcc/$CC): the blend index is built with numpy (slower with many corpora)")
        return None
    tag = hashlib.sha256((SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:12]
    try:
        where = build_once(resolve_cache_dir() / f"blend-kernel-{tag}", lambda out: _compile(out, cc))
        lib = ctypes.CDLL(str(where / "blend.so"))
    except OSError as e:
        log(f"compiling the blend kernel with {cc} failed ({e}): the blend index is built with numpy")
        return None
    f = lib.megasparse_blend
    f.restype = None
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    f.argtypes = [ptr, i32, i64, i64, ptr, ptr, ptr]
    _lib = lib
    return lib


def run(lib: ctypes.CDLL, w: np.ndarray, size: int, start: int, counts: np.ndarray):
    """(dataset_index int16, dataset_sample_index int64, counts after) of ``size`` samples from ``start``."""
    w = np.ascontiguousarray(w, dtype=np.float64)
    c = np.array(counts, dtype=np.float64)
    di, dsi = np.empty(size, dtype=np.int16), np.empty(size, dtype=np.int64)
    lib.megasparse_blend(w.ctypes.data, len(w), start, size, c.ctypes.data, di.ctypes.data, dsi.ctypes.data)
    return di, dsi, c.astype(np.int64)
