"""fp8 GEMM benchmark (decision 1000): Llama-3-8B's linear layers at TP=1 and TP=2, bf16 against megasparse's fp8
GEMMs (``megasparse/fp8/``) and, when it imports, torchao's float8 training linear on the same shapes.

Per layer (qkv 4096→6144, proj 4096→4096, fc1 4096→2·14336, fc2 14336→4096, output dims split by TP) and token
count (4096, 8192 rows in the forward; the backward on all rows, or on 0.6 of them as the compact backward sees
them): the forward, input-gradient and weight-gradient times, each including its casts (fp8: amax + scaled cast
of the activation / gradient; the weight-gradient's transposed casts and the add into the fp32 bucket). Anchors in
the same run: bf16 GEMMs as the layers run them (the weight gradient with ``accumulate_mm`` into fp32), and
megasparse fp8 with the weight gradient left in bf16 (``wgrad_fp8=False``). torchao (if importable): its
``Float8Linear`` (tensorwise / rowwise recipes), forward + backward of the module, eager and ``torch.compile``d,
against a bf16 ``nn.Linear`` timed the same way (full rows and the first token count only: it has no compact
backward, and each compiled module costs a compile). Optional: fp8 2:4
through cuSPARSELt (e4m3, ``torch._cslt_sparse_mm``) for the FFN forward, where this torch allows it.

    python benchmarks/bench_fp8.py [--out FILE.json] [--tokens 4096 8192] [--tp 1 2] [--quick]

Prints the device, the checks, then the tables last; writes JSON (default docs/benchmarks/data/bench_fp8_<gpu>.json).
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

from bench_sparse24 import RESULTS as _SPARSE_RESULTS  # noqa: E402
from bench_sparse24 import bench, rel, section  # noqa: E402 - the timing, error and section helpers

from megasparse.fp8.cast import E4M3, E5M2, quantize  # noqa: E402
from megasparse.fp8.gemm import Fp8Gemm  # noqa: E402
from megasparse.ops.wgrad import accumulate_mm  # noqa: E402

H, FFN, Q, KV = 4096, 14336, 4096, 1024  # Llama-3-8B: 32 heads / 8 KV heads of 128
LAYERS = {  # name: (in, out, split) with split = which side TP divides
    "qkv": (H, Q + 2 * KV, "out"),
    "proj": (Q, H, "in"),
    "fc1": (H, 2 * FFN, "out"),
    "fc2": (FFN, H, "in"),
}
RESULTS: dict = {"checks": [], "rows": [], "torchao": [], "sparse_fp8": [], "notes": _SPARSE_RESULTS["notes"]}
"""``notes`` is the list ``section`` appends a failed section's error to."""


def shape(layer: str, tp: int) -> tuple[int, int]:
    k, n, split = LAYERS[layer]
    return (k, n // tp) if split == "out" else (k // tp, n)


def operands(k: int, n: int, t: int, dev):
    g = torch.Generator(device=dev).manual_seed(k + n + t)
    w = torch.nn.Parameter(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(t, k, device=dev, generator=g).to(torch.bfloat16)
    dy = (torch.randn(t, n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
    return w, x, dy


@section("checks")
def checks(dev) -> None:
    """fp8 against bf16 on one shape per recipe: the error fp8 costs (not a pass/fail: the tests hold exactness)."""
    k, n, t = 4096, 6144, 4096
    w, x, dy = operands(k, n, t, dev)
    wb = w.detach().to(torch.bfloat16)
    for recipe in ("tensorwise", "rowwise"):
        gm = Fp8Gemm(w, recipe)
        w8 = gm.operand()
        out = torch.zeros(n, k, device=dev)
        gm.wgrad_into(dy, x, out)
        RESULTS["checks"].append(
            {
                "recipe": recipe,
                "shape": [t, k, n],
                "fwd_rel_err_vs_bf16": rel(gm.fwd(x, w8), x @ wb.t()),
                "dgrad_rel_err_vs_bf16": rel(gm.dgrad(dy, w8), dy @ wb),
                "wgrad_rel_err_vs_fp32": rel(out, dy.float().t() @ x.float()),
            }
        )


def _times_bf16(w, x, dy, kept: int) -> dict:
    wb = w.detach().to(torch.bfloat16)
    gk, xk = dy[:kept].contiguous(), x[:kept].contiguous()
    out = torch.zeros(w.shape, device=w.device)
    return {
        "fwd": bench(lambda: x @ wb.t()),
        "dgrad": bench(lambda: gk @ wb),
        "wgrad": bench(lambda: accumulate_mm(out, gk.t(), xk)),
    }


def _times_fp8(w, x, dy, kept: int, recipe: str, wgrad_fp8: bool = True) -> dict:
    gm = Fp8Gemm(w, recipe, wgrad_fp8=wgrad_fp8)
    w8 = gm.operand()
    gk, xk = dy[:kept].contiguous(), x[:kept].contiguous()
    out = torch.zeros(w.shape, device=w.device)
    ax = "row" if recipe == "rowwise" else "tensor"
    col = "col" if recipe == "rowwise" else "tensor"
    pad = -(-kept // 16) * 16
    r = {
        "fwd": bench(lambda: gm.fwd(x, w8)),
        "dgrad": bench(lambda: gm.dgrad(gk, w8)),
        "wgrad": bench(lambda: gm.wgrad_into(gk, xk, out)),
        "refresh": bench(gm.refresh),  # once per optimizer step, not per micro-batch
        "cast_x": bench(lambda: quantize(x, E4M3, ax)),
        "cast_g": bench(lambda: quantize(gk, E5M2, ax)),
    }
    if wgrad_fp8:
        r["cast_wgrad"] = bench(lambda: quantize(gk, E5M2, col, True, pad)) + bench(
            lambda: quantize(xk, E4M3, col, True, pad)
        )
    return r


@section("gemms")
def gemm_table(dev, tokens: list[int], tps: list[int], keep: float) -> None:
    for tp in tps:
        for t in tokens:
            for kept in (t, int(round(keep * t))):
                for layer in LAYERS:
                    k, n = shape(layer, tp)
                    w, x, dy = operands(k, n, t, dev)
                    row = {"tp": tp, "layer": layer, "tokens": t, "bwd_rows": kept, "k": k, "n": n}
                    row["bf16"] = _times_bf16(w, x, dy, kept)
                    for recipe in ("tensorwise", "rowwise"):
                        row[recipe] = _times_fp8(w, x, dy, kept, recipe)
                        row[recipe + "_wgrad_bf16"] = _times_fp8(w, x, dy, kept, recipe, wgrad_fp8=False)
                    RESULTS["rows"].append(row)
                    del w, x, dy
                torch.cuda.empty_cache()


def _module_time(mod, x, dy) -> float:
    def step():
        y = mod(x)
        y.backward(dy)

    return bench(step)


@section("torchao")
def torchao_table(dev, tokens: list[int], tps: list[int]) -> None:
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        RESULTS["notes"].append(f"torchao not importable: {type(e).__name__}: {e}")
        return
    RESULTS["torchao_version"] = torchao.__version__
    for tp in tps:
        for t in tokens:
            for layer in LAYERS:
                k, n = shape(layer, tp)
                _, x, dy = operands(k, n, t, dev)
                x = x.detach().requires_grad_()
                row = {"tp": tp, "layer": layer, "tokens": t}
                for name in ("bf16", "tensorwise", "rowwise"):
                    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
                    if name != "bf16":
                        cfg = Float8LinearConfig.from_recipe_name(name)
                        lin = convert_to_float8_training(torch.nn.Sequential(lin), config=cfg)
                    row[name + "_eager"] = _module_time(lin, x, dy)
                    row[name + "_compiled"] = _module_time(torch.compile(lin), x, dy)
                RESULTS["torchao"].append(row)
                torch._dynamo.reset()
            torch.cuda.empty_cache()


def _sparse_row(dev, tp: int, t: int, layer: str) -> dict:
    from megasparse.sparse24.masks import transposable_mask

    k, n = shape(layer, tp)
    w, x, _ = operands(k, n, t, dev)
    ws = w.detach() * transposable_mask(w.detach())
    q8, s8 = quantize(ws, E4M3, "tensor")
    xq, xs = quantize(x, E4M3, "tensor")
    row = {"tp": tp, "layer": layer, "tokens": t}
    try:
        packed = torch._cslt_compress(q8)
        alpha = (s8 * xs).reshape(1).expand(n).contiguous()  # cuSPARSELt's per-row alpha vector

        def sp():
            return torch._cslt_sparse_mm(packed, xq.t(), alpha=alpha, out_dtype=torch.bfloat16, transpose_result=True)

        row["rel_err_vs_emulated"] = rel(sp(), (xq.float() * xs) @ (q8.float() * s8).t())
        row["sparse_fp8_fwd"] = bench(sp)
    except Exception as e:  # noqa: BLE001 - the torch build may not take fp8 here: record why
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    gm = Fp8Gemm(torch.nn.Parameter(ws), "tensorwise")
    w8 = gm.operand()
    row["dense_fp8_fwd"] = bench(lambda: gm.fwd(x, w8))
    wb = ws.to(torch.bfloat16)
    row["bf16_fwd"] = bench(lambda: x @ wb.t())
    return row


@section("sparse_fp8")
def sparse_fp8_table(dev, tokens: list[int], tps: list[int]) -> None:
    """fp8 2:4 forward (Y = X·Wᵀ with W 2:4 in e4m3 through cuSPARSELt) against the dense fp8 and bf16 forwards."""
    for tp in tps:
        for t in tokens:
            for layer in ("fc1", "fc2"):
                RESULTS["sparse_fp8"].append(_sparse_row(dev, tp, t, layer))
            torch.cuda.empty_cache()


def _total(r: dict) -> float:
    return r["fwd"] + r["dgrad"] + r["wgrad"]


def print_tables() -> None:
    print("\nnotes:", *RESULTS["notes"], sep="\n  ")
    print(f"\ndevice: {RESULTS['device']}  {RESULTS['versions']}")
    print("fp8 error against bf16 / fp32 (one shape):")
    for c in RESULTS["checks"]:
        print(f"  {c['recipe']:<10} fwd {c['fwd_rel_err_vs_bf16']:.2e}  dgrad {c['dgrad_rel_err_vs_bf16']:.2e}  "
              f"wgrad {c['wgrad_rel_err_vs_fp32']:.2e}")  # fmt: skip
    print("\nper GEMM, ms, fwd + dgrad + wgrad (casts included); x = bf16 total / fp8 total; "
          "tw = tensorwise, rw = rowwise, -bw = wgrad in bf16")  # fmt: skip
    print("  tp tokens bwd  layer  bf16 f/d/w            tw f/d/w              tw x   rw x   tw-bw x rw-bw x  "
          "cast x/g tw  refresh tw")  # fmt: skip
    sums: dict = {}
    for r in RESULTS["rows"]:
        b, tw, rw = r["bf16"], r["tensorwise"], r["rowwise"]
        twb, rwb = r["tensorwise_wgrad_bf16"], r["rowwise_wgrad_bf16"]
        key = (r["tp"], r["tokens"], r["bwd_rows"])
        s = sums.setdefault(key, {"bf16": 0.0, "tw": 0.0, "rw": 0.0, "twb": 0.0, "rwb": 0.0})
        for name, v in (("bf16", b), ("tw", tw), ("rw", rw), ("twb", twb), ("rwb", rwb)):
            s[name] += _total(v)
        print(
            f"  {r['tp']:<2} {r['tokens']:<6} {r['bwd_rows']:<4} {r['layer']:<5} "
            f"{b['fwd']:.3f}/{b['dgrad']:.3f}/{b['wgrad']:.3f}  {tw['fwd']:.3f}/{tw['dgrad']:.3f}/{tw['wgrad']:.3f}  "
            f"{_total(b) / _total(tw):.2f}   {_total(b) / _total(rw):.2f}   {_total(b) / _total(twb):.2f}    "
            f"{_total(b) / _total(rwb):.2f}     {tw['cast_x']:.3f}/{tw['cast_g']:.3f}  {tw['refresh']:.3f}"
        )
    print("\nper layer (qkv + proj + fc1 + fc2), ms fwd+dgrad+wgrad; speed-up over bf16 in brackets")
    for (tp, t, kept), s in sums.items():
        print(
            f"  tp={tp} tokens={t} bwd rows={kept}: bf16 {s['bf16']:.2f} | tensorwise {s['tw']:.2f} "
            f"({s['bf16'] / s['tw']:.2f}x) | rowwise {s['rw']:.2f} ({s['bf16'] / s['rw']:.2f}x) | tensorwise, bf16 "
            f"wgrad {s['twb']:.2f} ({s['bf16'] / s['twb']:.2f}x) | rowwise, bf16 wgrad {s['rwb']:.2f} "
            f"({s['bf16'] / s['rwb']:.2f}x)"
        )
    if RESULTS["torchao"]:
        print(f"\ntorchao {RESULTS.get('torchao_version')} Float8Linear, fwd+bwd of the module, ms (eager / compiled)")
        for r in RESULTS["torchao"]:
            print(
                f"  tp={r['tp']} tokens={r['tokens']} {r['layer']:<5} bf16 {r['bf16_eager']:.3f}/"
                f"{r['bf16_compiled']:.3f}  tensorwise {r['tensorwise_eager']:.3f}/{r['tensorwise_compiled']:.3f}  "
                f"rowwise {r['rowwise_eager']:.3f}/{r['rowwise_compiled']:.3f}"
            )
    if RESULTS["sparse_fp8"]:
        print("\nfp8 2:4 forward through cuSPARSELt, ms (dense fp8 and bf16 forwards alongside)")
        for r in RESULTS["sparse_fp8"]:
            sp = f"{r['sparse_fp8_fwd']:.3f} (err {r['rel_err_vs_emulated']:.1e})" if "sparse_fp8_fwd" in r else "—"
            print(f"  tp={r['tp']} tokens={r['tokens']} {r['layer']:<4} sparse fp8 {sp}  dense fp8 "
                  f"{r['dense_fp8_fwd']:.3f}  bf16 {r['bf16_fwd']:.3f}  {r.get('error', '')}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="JSON file (default docs/benchmarks/data/bench_fp8_<gpu>.json)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--keep", type=float, default=0.6, help="kept fraction of the compact backward's rows")
    p.add_argument("--quick", action="store_true", help="4096 tokens, TP=1, no torchao / 2:4 sections")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs a CUDA GPU with fp8 GEMMs (sm_89+)")
        return 1
    import triton

    dev = torch.device("cuda")
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    print(RESULTS["device"], RESULTS["versions"], flush=True)
    tokens, tps = ([4096], [1]) if args.quick else (args.tokens, args.tp)
    checks(dev)
    gemm_table(dev, tokens, tps, args.keep)
    if not args.quick:
        torchao_table(dev, tokens[:1], tps)  # the first token count: each compiled module costs a compile
        sparse_fp8_table(dev, tokens, tps)
    names = re.findall(r"\b[A-Z]\d{2,3}\b", RESULTS["device"])  # "NVIDIA H100 80GB HBM3" -> h100
    gpu = names[0].lower() if names else "gpu"
    data = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "data")
    out = args.out or os.path.join(data, f"bench_fp8_{gpu}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=str)
    print(f"wrote {os.path.abspath(out)}")
    print_tables()
    return 0


if __name__ == "__main__":
    sys.exit(main())
