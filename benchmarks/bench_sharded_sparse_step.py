"""The 2:4 weights' optimizer step under the distributed optimizer, before and after decision 1237, at one pipeline
stage's FFN weights.

    python benchmarks/bench_sharded_sparse_step.py [--layers 16] [--hidden 4096] [--ffn 14336] [--dp 2] [--reps 10]

One DP rank's owned pieces (1/dp of each FFN weight: fc1 [2·ffn, hidden], fc2 [hidden, ffn] per layer; the defaults
are the whole Llama-3-8B's PP2 stage at DP2, 1.41e9 elements) with fp32 masters, gradients and moments, a bool mask
and the bf16 parameter, stepped two ways from the same state:
- ``decay + foreach AdamW`` (decision 1236): the masked-decay pass over the owned gradient (reads the bf16
  parameter), then ``torch.optim.AdamW(foreach=True)`` over the master pieces, as ``DistributedAdamW`` ran it;
- ``decay + fused AdamW``: the same with torch's fused AdamW, what ``DistributedAdamW`` runs on CUDA since decision
  1238 for every other parameter (the cost 2:4's pieces would have without decision 1237);
- ``fused masked_adamw_`` (decision 1237): one pass per piece, the decay reading the fp32 master.
Prints milliseconds (CUDA events, median over ``--reps``), the bytes each way moves by the pass count below, and
how far apart the first and last ways leave the masters after one step (relative to their norm); writes the same to
``--out`` (default on CUDA: ``docs/benchmarks/data/sharded_sparse_step_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_masked_decay import DATA, _time  # noqa: E402
from megasparse.sparse24.decay import masked_decay_  # noqa: E402
from megasparse.sparse24.optim import masked_adamw_, masked_adamw_reference  # noqa: E402

LAMBDA, LR, BETAS, EPS, WD = 2e-4, 3e-4, (0.9, 0.95), 1e-8, 0.1
# fp32 bytes per element of torch's non-capturable foreach AdamW (torch/optim/adam.py, _multi_tensor_adam): p *= 1-lr·wd
# (8), lerp m (12), v *= β2 (8), addcmul v (12), t = sqrt(v) (8), t /= bc2 (8), t += eps (8), p addcdiv (16)
FOREACH_ADAMW = 80
FUSED_ADAMW = 28  # p, g, m, v in; p, m, v out (torch's fused kernel)
DECAY = 11  # g, bf16 W, M in; g out (decision 1236)
FUSED = 29  # p, g, m, v, M in; p, m, v out


def pieces(a: argparse.Namespace, dev: torch.device) -> list[dict[str, torch.Tensor]]:
    """One rank's owned piece of every FFN weight."""
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for shape in [(2 * a.ffn, a.hidden), (a.hidden, a.ffn)] * a.layers:
        k = shape[0] * shape[1] // a.dp
        p = 0.02 * torch.randn(k, device=dev, generator=gen)
        g = 1e-3 * torch.randn(k, device=dev, generator=gen)
        v = 1e-6 * torch.rand(k, device=dev, generator=gen)
        m = torch.rand(k, device=dev, generator=gen) < 0.5
        out.append({"p": p, "g": g, "m": 1e-3 * torch.randn(k, device=dev, generator=gen), "v": v, "M": m})
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (times mean nothing)")
    ap.add_argument("--out", default=None, help="JSON file (default on CUDA: docs/benchmarks/data/...)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    ps = pieces(a, dev)
    n = sum(x["p"].numel() for x in ps)
    w16 = [x["p"].bfloat16() for x in ps]  # the bf16 parameter the unfused decay reads
    start = [{k: x[k].clone() for k in ("p", "g", "m", "v")} for x in ps]  # ~16 B an element: ~65 GB in all
    views = [x["p"] for x in ps]
    for x, w in zip(views, ps):
        x.grad = w["g"]
    opts = {}
    for kind in ("foreach", "fused"):  # the distributed optimizer's state: views of its buffers
        opt = torch.optim.AdamW(views, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
        for x, w in zip(views, ps):  # fused keeps its step count on the device, foreach on the host
            step0 = torch.zeros((), dtype=torch.float32, device=dev if kind == "fused" else "cpu")
            opt.state[x] = {"step": step0, "exp_avg": w["m"], "exp_avg_sq": w["v"]}
        opts[kind] = opt
    step = [1]
    fused = masked_adamw_ if dev.type == "cuda" else masked_adamw_reference

    def decay_then(kind: str):
        def run() -> None:
            for x, w in zip(ps, w16):
                masked_decay_(x["g"], w, x["M"], LAMBDA)
            opts[kind].step()

        return run

    unfused = decay_then("foreach")

    def one_pass() -> None:
        for x in ps:
            fused(x["p"], x["g"], x["m"], x["v"], x["M"], step[0], LR, *BETAS, EPS, WD, LAMBDA)

    def restore() -> None:
        with torch.no_grad():
            for x, s in zip(ps, start):
                for k in ("p", "g", "m", "v"):
                    x[k].copy_(s[k])
        for opt in opts.values():
            for st in opt.state.values():
                st["step"].zero_()

    restore()
    unfused()
    after_unfused = torch.cat([x["p"] for x in ps])
    restore()
    one_pass()
    apart = ((torch.cat([x["p"] for x in ps]) - after_unfused).norm() / after_unfused.norm()).item()
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{where}: {n / 1e9:.2f}e9 owned FFN elements in {len(ps)} pieces (dp {a.dp})")
    res = {"elements": float(n), "apart": apart}
    for name, fn, per in (
        ("decay + foreach AdamW", unfused, DECAY + FOREACH_ADAMW),
        ("decay + fused AdamW", decay_then("fused"), DECAY + FUSED_ADAMW),
        ("fused masked_adamw_", one_pass, FUSED),
    ):
        t = _time(fn, a.reps, dev)  # repeated steps from a moving state: the time, not the values, matters here
        res[name] = t
        print(f"{name:>22}: {t:8.2f} ms  {per:3d} B/elt  {per * n / 1e9:6.1f} GB  {per * n / t / 1e6:6.0f} GB/s")
    print(f"masters one step apart: {apart:.2e} of their norm (the decay reads the fp32 master, not bf16)")
    if a.out or dev.type == "cuda":  # a CPU smoke run writes only where it is told to
        tag = where.replace("NVIDIA ", "").split()[0].lower()
        path = Path(a.out) if a.out else DATA / f"sharded_sparse_step_{tag}.json"
        path.write_text(json.dumps({"device": where, "torch": torch.__version__, "args": vars(a), **res}, indent=1))
        print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
