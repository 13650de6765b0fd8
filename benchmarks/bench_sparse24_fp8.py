"""What the 2:4 recipe's weights cost per optimizer step under fp8 (decision 1235), at Llama-3-8B's FFN shapes.

With ``train.fp8`` on, a 2:4 layer's three GEMMs are dense fp8 over W ⊙ M, and after each optimizer step its fp8
weight copies (W and Wᵀ in e4m3, one tensorwise scale) are made again. Timed here on one GPU for fc1 [2·14336, 4096]
and fc2 [4096, 14336] with bf16 W (the distributed optimizer's parameters), tensorwise:

  dense    the copies of W alone: fp8 without 2:4, the floor
  product  W * M, then the casts of the product (the code before decision 1235)
  masked   the casts reading W and M, no product (decision 1235); checked bit for bit against ``product``
  packing  the cuSPARSELt values of W ⊙ M and its transpose (``Sparse24Weight.refresh``), which the manager's
           states rebuilt every step before decision 1235 whenever the autotune had the sparse GEMMs on

and the bytes those cuSPARSELt operands held. Totals for one PP2 stage of the 8B (``--layers`` 16).

    python benchmarks/bench_sparse24_fp8.py [--layers 16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_sparse24 import bench  # noqa: E402 - triton's do_bench, median

from megasparse.fp8.cast import E4M3, quantize_triton  # noqa: E402
from megasparse.sparse24.linear import Sparse24Weight  # noqa: E402
from megasparse.sparse24.masks import transposable_mask  # noqa: E402

SHAPES = {"fc1": (2 * 14336, 4096), "fc2": (4096, 14336)}


def layer(name: str, dev: torch.device) -> dict:
    w = (torch.randn(*SHAPES[name], device=dev) * 0.02).to(torch.bfloat16)
    m = transposable_mask(w)
    new = quantize_triton(w, E4M3, "tensor", transpose=True, mask=m)
    old = quantize_triton(w * m, E4M3, "tensor", transpose=True)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(new[:2], old[:2]))
    same = same and torch.equal(new[2], old[2])
    st = Sparse24Weight(w, m, backend="cusparselt", name=name)
    st.refresh(w, force=True)  # the metadata (once per mask), then the values each step
    packed = sum(t.numel() * t.element_size() for t in (st.packed, st.packed_t))
    row = {
        "layer": name,
        "shape": list(w.shape),
        "bitwise_equal": same,
        "dense_ms": bench(lambda: quantize_triton(w, E4M3, "tensor", transpose=True)),
        "product_ms": bench(lambda: quantize_triton(w * m, E4M3, "tensor", transpose=True)),
        "masked_ms": bench(lambda: quantize_triton(w, E4M3, "tensor", transpose=True, mask=m)),
        "packing_ms": bench(lambda: st.refresh(w, force=True)),
        "packed_bytes_per_element": packed / w.numel(),
        "packed_bytes": packed,
    }
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16, help="transformer layers on the stage (8B at PP2: 16)")
    p.add_argument("--out", default=None, help="JSON file (default docs/benchmarks/data/sparse24_fp8_<device>.json)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse24_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for n in SHAPES:
        rows.append(layer(n, dev))
        torch.cuda.empty_cache()
    stage = {k: a.layers * sum(r[k] for r in rows) for k in ("dense_ms", "product_ms", "masked_ms", "packing_ms")}
    stage["packed_gib"] = a.layers * sum(r["packed_bytes"] for r in rows) / 2**30
    stage["masks_gib"] = a.layers * sum(r["shape"][0] * r["shape"][1] for r in rows) / 2**30
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("layer  shape            dense ms  product ms  masked ms  packing ms  packed B/elem  bitwise")
    for r in rows:
        print(
            f"{r['layer']:<6} {str(r['shape']):<16} {r['dense_ms']:8.3f}  {r['product_ms']:10.3f}"
            f"  {r['masked_ms']:9.3f}  {r['packing_ms']:10.3f}  {r['packed_bytes_per_element']:13.3f}"
            f"  {r['bitwise_equal']}"
        )
    print(
        f"stage ({a.layers} layers): fp8 copies dense {stage['dense_ms']:.2f} ms, product {stage['product_ms']:.2f} ms,"
        f" masked {stage['masked_ms']:.2f} ms; packing {stage['packing_ms']:.2f} ms a step while it ran; cuSPARSELt"
        f" operands {stage['packed_gib']:.2f} GiB (gone), masks {stage['masks_gib']:.2f} GiB (kept)"
    )
    name = torch.cuda.get_device_name()
    tag = name.replace("NVIDIA ", "").split()[0].lower()
    out = a.out or str(
        Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "data" / f"sparse24_fp8_{tag}.json"
    )
    with open(out, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "rows": rows, "stage": stage}, f, indent=1)
    print(f"wrote {out}")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
