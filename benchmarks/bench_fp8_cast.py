"""fp8 cast-kernel tiling sweep (``megasparse/fp8/cast.py``'s ``TILES``): which (rows, columns, warps) per program
moves a Llama-3-8B layer's casts fastest on this card.

In the whole-8B fp8 step at DP 4, mb 2, on four H200s the casts and amax passes took 232 ms of 2160 (1,664 calls
each; ``docs/benchmarks/reports/2026-11-27-4xh200-whole-8b.md``), at about half the card's memory bandwidth. Any
tiling gives the same bits (``tests/test_fp8.py`` sweeps some under the interpreter; this script checks every
candidate against the current setting on the GPU too), so the choice is speed alone.

One layer and micro-batch of ``--tokens`` rows (8192: mb 2 at seq 4096) with tensorwise scaling and the fp8 weight
gradient, as ``fp8/gemm.py`` runs them:

- ``amax``: the input of qkv, proj, fc1 (4096 wide) and fc2 (14336), and the output gradient of each (6144, 4096,
  28672, 4096);
- ``cast``: the forward's cast of each input;
- ``cast_t``: the gradient's cast with its padded transpose (dgrad and wgrad from one read), and the weight
  gradient's transposed cast of each input (its amax handed over, decision 1242).

    python benchmarks/bench_fp8_cast.py [--tokens 8192] [--out FILE.json]

Prints the device, each candidate's time per layer and bandwidth, then the fastest ``TILES`` line last; writes JSON
(default ``docs/benchmarks/data/bench_fp8_cast_<gpu>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

sys.path.insert(0, os.path.dirname(__file__))

from bench_sparse24 import bench  # noqa: E402 - the fp8 benchmarks' timer (triton's do_bench, median)

import megasparse.fp8.cast as cast  # noqa: E402

H, FFN, QKV = 4096, 14336, 6144
INPUTS = (H, H, H, FFN)  # qkv, proj, fc1, fc2: input widths
GRADS = (QKV, H, 2 * FFN, H)  # their output widths (fc1 is gate and up)
CANDIDATES = {
    "amax": [(64, 64, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 512, 4), (128, 256, 8)],
    "cast": [(64, 64, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 512, 4)],
    "cast_t": [(64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 128, 8), (128, 128, 8), (32, 128, 4), (128, 32, 4)],
}


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def layer_work(kind: str, xs: list[torch.Tensor], gs: list[torch.Tensor]):
    """One layer's calls of one kernel kind, as a closure; and the bytes they move (read + written)."""
    t = xs[0].shape[0]
    amaxes = [cast.amax_triton(x) for x in xs]
    if kind == "amax":
        ops = xs + gs
        return (lambda: [cast.amax_triton(a) for a in ops]), sum(a.numel() * 2 for a in ops)
    if kind == "cast":
        return (lambda: [cast.quantize_triton(x, cast.E4M3, amax=a) for x, a in zip(xs, amaxes)]), sum(
            x.numel() * 3 for x in xs
        )
    pad = _pad16(t)

    def run():
        for g in gs:  # dgrad: q and its transpose from one read (the amax pass is the amax kind's)
            cast.quantize_triton(g, cast.E5M2, transpose=True, pad_to=pad, amax=cast.amax_triton(g))
        for x, a in zip(xs, amaxes):
            cast.quantize_triton(x, cast.E4M3, write_q=False, transpose=True, pad_to=pad, amax=a)

    return run, sum(g.numel() * 4 for g in gs) + sum(x.numel() * 3 for x in xs)


def masked_weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W, transposable 2:4 mask) pairs, bf16, the refresh's masked casts (decision 1235): an odd shape and fc1's.
    On sm_90 the 128x128, 8-warp transposing tile gave wrong bits here while unmasked casts matched (2026-11-27)."""
    from megasparse.sparse24.masks import transposable_mask

    g = torch.Generator(device="cuda").manual_seed(3)
    out = []
    for r, c in ((1000, 772), (2 * 14336, 4096)):
        w = (torch.randn(r, c, device="cuda", generator=g) * torch.logspace(-3, 2, c, device="cuda")).to(torch.bfloat16)
        out.append((w, transposable_mask(w)))
    return out


def outputs(xs: list[torch.Tensor], gs: list[torch.Tensor], ws: list | None = None) -> list[torch.Tensor]:
    """Every kind's results under the current ``TILES``, to compare candidates bit for bit (``ws``: the masked
    weight casts, ``masked_weights``)."""
    pad = _pad16(xs[0].shape[0])
    out = [cast.amax_triton(a) for a in xs + gs]
    for w, m in ws or []:
        for axis in ("tensor", "row", "col"):
            q, qt, s = cast.quantize_triton(w, cast.E4M3, axis, transpose=True, mask=m)
            out += [q.view(torch.uint8), qt.view(torch.uint8), s]
    for x in xs:
        q, _, s = cast.quantize_triton(x, cast.E4M3)
        out += [q.view(torch.uint8), s]
    for g in gs:
        q, qt, s = cast.quantize_triton(g, cast.E5M2, transpose=True, pad_to=pad)
        out += [q.view(torch.uint8), qt.view(torch.uint8), s]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_fp8_cast: needs a CUDA GPU (which tiling is fastest is a question of the card; "
            "on CPU tests/test_fp8.py checks that every tiling gives the same bits)"
        )
    dev = torch.cuda.get_device_name()
    print(f"bench_fp8_cast | {dev} | {a.tokens} tokens, bf16, one Llama-3-8B layer's casts | torch {torch.__version__}")
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(a.tokens, c, device="cuda", generator=g).to(torch.bfloat16) for c in INPUTS]
    gs = [(torch.randn(a.tokens, c, device="cuda", generator=g) * 1e-3).to(torch.bfloat16) for c in GRADS]
    ws = masked_weights()
    default = dict(cast.TILES)
    ref = outputs(xs, gs, ws)
    rows, best = [], {}
    for kind, cands in CANDIDATES.items():
        for tile in cands:
            cast.TILES.update(default)
            cast.TILES[kind] = tile
            same = all(torch.equal(u, v) for u, v in zip(outputs(xs, gs, ws), ref))
            fn, nbytes = layer_work(kind, xs, gs)
            ms = bench(fn)
            row = {
                "kind": kind,
                "tile": list(tile),
                "ms_per_layer": ms,
                "gb_per_s": nbytes / ms / 1e6,
                "same_bits": same,
            }
            rows.append(row)
            if same and (kind not in best or ms < best[kind]["ms_per_layer"]):
                best[kind] = row
    cast.TILES.update(default)
    head = f"{'kind':<7} {'rows':>5} {'cols':>5} {'warps':>5} {'ms/layer':>9} {'GB/s':>7} {'vs now':>7} {'bits':>5}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        now = next(x for x in rows if x["kind"] == r["kind"] and tuple(x["tile"]) == default[r["kind"]])
        print(
            f"{r['kind']:<7} {r['tile'][0]:>5} {r['tile'][1]:>5} {r['tile'][2]:>5} {r['ms_per_layer']:9.3f} "
            f"{r['gb_per_s']:7.0f} {r['ms_per_layer'] / now['ms_per_layer']:7.3f} "
            f"{'same' if r['same_bits'] else 'DIFF':>5}"
        )
    print("vs now: time over the current TILES entry (< 1: faster); bits: every output equal to the current tiling's")
    line = ", ".join(f'"{k}": {tuple(v["tile"])}' for k, v in best.items())
    print(f"fastest: TILES = {{{line}}}")
    out = a.out or f"docs/benchmarks/data/bench_fp8_cast_{re.sub(r'[^a-z0-9]+', '_', dev.lower()).strip('_')}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": dev, "tokens": a.tokens, "torch": torch.__version__, "current": default, "cases": rows,
                   "fastest": {k: v["tile"] for k, v in best.items()}}, f, indent=1)  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
