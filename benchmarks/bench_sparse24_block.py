"""2:4 sparse FFN at transformer-block and whole-trainer-step level, against dense in the same run.

    python benchmarks/bench_sparse24_block.py [--out $OUT/bench_sparse24_block.json] [--small]
        [--micro 1,2,4] [--gbs 8] [--backend auto]   (torchrun --nproc_per_node 1 works too)

1. Correctness first: one megasparse TransformerBlock made sparse by the trainer's own code path
   (the trainer's ``Sparse24Converter``: SparsityManager + Sparse24Gemm on fc1/fc2) takes one AdamW step, so its next
   forward uses the per-step value-refresh path; a dense block with the same weights, fc1/fc2 multiplied by the
   masks (what the emulate backend computes), must agree within bf16 tolerance on the FFN output, the fc1/fc2
   weight gradients and the mlp-norm weight gradient (which only fc1's input gradient reaches). Control: the
   same comparison against the unmasked weights must fail it. Prints OK/FAIL; exit status 1 on FAIL.
2. Block: ~1B shapes (configs/gpu_1b_1gpu.yaml) and a Llama-3-8B-like block, [s, b, h] = [4096, 4, h] (16384
   tokens), bf16 compute on fp32 masters like the trainer. A step is zero_grad, forward+backward, masked decay,
   AdamW, ``SparsityManager.after_step(step)`` — synchronised and timed in pieces; the reported block time is
   everything but the optimizer (identical for both; reported separately). Steps are numbered as in training,
   so the window contains mask refreshes at their real cadence (every ``sparsity.refresh_interval`` = 40):
   sparse ms = median of ordinary steps + (extra time of a refresh step and the step after it, whose forward
   recompresses) / 40.
3. End to end: ``Trainer(cfg, init_groups=False).train_step()`` on configs/gpu_1b_1gpu.yaml with synthetic
   data, dense vs ``sparsity.enabled=true``; warm-up 2, median of 5 timed steps, then the step counter is
   moved so the next step is a mask-refresh step: that step and the next are timed twice and their excess over
   the median is amortised over 40 explicitly. Peak memory over the timed steps.

Anchor: the dense path in the same run; speedup = dense ms / sparse ms (> 1: sparse faster). The table is
printed last; ``--small`` runs tiny shapes on CPU with the emulate backend (plumbing only, no timing claims).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_trainer import _free, _peak_gib, _reset_peak, _sync  # noqa: E402

from megasparse.config import Config, load_config  # noqa: E402
from megasparse.model.gpt import TransformerBlock  # noqa: E402
from megasparse.ops.attention import rope_tables  # noqa: E402
from megasparse.parallel import state  # noqa: E402
from megasparse.sparse24 import linear as lin  # noqa: E402
from megasparse.sparse24.converter import Sparse24Converter  # noqa: E402
from megasparse.train import Trainer  # noqa: E402

CONFIG = ROOT / "configs" / "gpu_1b_1gpu.yaml"
BLOCKS = {  # name -> model overrides on top of CONFIG
    "1b": [],
    "llama3-8b": [
        "model.num_layers=32", "model.hidden_size=4096", "model.num_attention_heads=32",
        "model.num_query_groups=8", "model.ffn_hidden_size=14336", "model.rope_theta=500000.0",
    ],
}  # fmt: skip
SMALL_BLOCKS = {
    "1b": ["model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
           "model.ffn_hidden_size=256"],
    "llama3-8b": ["model.hidden_size=256", "model.num_attention_heads=8", "model.num_query_groups=2",
                  "model.ffn_hidden_size=448"],
}  # fmt: skip
SMALL_RUN = [
    "model.num_layers=2", "model.seq_length=64", "model.vocab_size=512", "train.device=cpu", "train.dtype=fp32",
    "sparsity.backend=emulate",
]  # fmt: skip
TOL = {"mlp_out": 2e-2, "fc1_wgrad": 3e-2, "fc2_wgrad": 3e-2, "mlp_norm_wgrad": 3e-2}
"""bf16 limits on ‖sparse − masked dense‖/‖masked dense‖; a wrong mask or value layout gives O(1)."""
RESULTS: dict = {"checks": [], "block": [], "e2e": [], "notes": []}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_cfg(args: argparse.Namespace, model_ov: list[str], extra: list[str] = ()) -> Config:
    ov = ["data.prefix=synthetic", f"sparsity.backend={args.backend}", *model_ov]
    if args.small:
        ov += SMALL_RUN
    cfg = load_config(CONFIG, [*ov, *extra])
    cfg.validate(1)
    return cfg


# ------------------------------------------------------------------------------------------------ block
def build_block(cfg: Config, dev: torch.device, dtype: torch.dtype, sparse: bool):
    """One TransformerBlock; when ``sparse``, its FFN is made 2:4 by the trainer's own Sparse24Converter."""
    block = TransformerBlock(cfg.model, 0, cfg.train.seed, dev, False, dtype, state.groups())
    mgr = None
    if sparse:
        cfg.sparsity.enabled = True
        mgr = Sparse24Converter(cfg.sparsity, cfg.train.steps, dtype).convert_linears(block.ffn_linears())
    o = cfg.optim
    groups = [
        {"params": [p for p in block.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in block.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=dev.type == "cuda")
    return block, mgr, opt


def block_step(block, mgr, opt, inp, step: int, dev: torch.device) -> tuple[float, float, bool]:
    """One training step of the block, in the trainer's order. Returns (seconds without the optimizer,
    optimizer seconds, whether after_step refreshed masks)."""
    x, gy, cos, sin = inp
    _sync(dev)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    x.grad = None
    block(x, cos, sin).backward(gy)
    if mgr is not None:
        mgr.apply_masked_decay()
    _sync(dev)
    t1 = time.perf_counter()
    opt.step()
    _sync(dev)
    t2 = time.perf_counter()
    rates = mgr.after_step(step) if mgr is not None else {}
    _sync(dev)
    t3 = time.perf_counter()
    return (t1 - t0) + (t3 - t2), t2 - t1, bool(rates)


def block_inputs(cfg: Config, batch: int, dev: torch.device, dtype: torch.dtype):
    m = cfg.model
    g = torch.Generator(device=dev).manual_seed(1234)
    x = torch.randn(m.seq_length, batch, m.hidden_size, device=dev, dtype=dtype, generator=g).requires_grad_(True)
    gy = torch.randn(m.seq_length, batch, m.hidden_size, device=dev, dtype=dtype, generator=g)
    cos, sin = rope_tables(m.seq_length, m.head_dim, m.rope_theta, dev)
    return x, gy, cos, sin


def _ffn_plans(block, tokens: int, dtype: torch.dtype) -> dict:
    """Which GEMM path each sparse linear took: cuSPARSELt or the masked-dense fallback, and its refresh mode."""
    out = {}
    for layer in (block.mlp.fc1, block.mlp.fc2):
        st = getattr(layer.gemm, "_state", None)
        rec = {"shape": list(layer.weight.shape), "cusparselt": False}
        if st is not None and st.can_sparse:
            plan = lin.decide(*st.shape, tokens, dtype, layer.weight.device, False)
            rec.update(cusparselt=bool(plan["sparse"]), fast_refresh=list(st.fast_refresh), note=st.layout_note)
            rec.update(decide_sparse_ms=plan["t_sparse_ms"], decide_dense_ms=plan["t_dense_ms"])
        out[layer.pname.split(".")[-1]] = rec
    return out


def check_block(name: str, cfg: Config, sparse_blk, mgr, opt, inp, dev, dtype) -> bool:
    """Sparse block (after one update) vs the same weights as a dense block with masked fc1/fc2."""
    block_step(sparse_blk, mgr, opt, inp, 1, dev)  # weights change: the next forward runs the value refresh
    ref, _, _ = build_block(cfg, dev, dtype, False)
    with torch.no_grad():
        for p, q in zip(sparse_blk.parameters(), ref.parameters(), strict=True):
            q.copy_(p)
    x, gy, cos, sin = inp

    def run(block) -> dict:
        seen = []
        hook = block.mlp.register_forward_hook(lambda mod, i, o: seen.append(o.detach().clone()))
        block.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        block(xx, cos, sin).backward(gy)
        hook.remove()
        return {
            "mlp_out": seen[0],
            "fc1_wgrad": block.mlp.fc1.weight.grad.clone(),
            "fc2_wgrad": block.mlp.fc2.weight.grad.clone(),
            "mlp_norm_wgrad": block.mlp_norm.weight.grad.clone(),
        }

    got = run(sparse_blk)
    unmasked = run(ref)
    with torch.no_grad():
        for layer in (ref.mlp.fc1, ref.mlp.fc2):
            layer.weight.mul_(mgr.masks[layer.pname + ".weight"])
    want = run(ref)
    rels = {k: rel(got[k], want[k]) for k in TOL}
    control = {k: rel(got[k], unmasked[k]) for k in TOL}
    ok = all(rels[k] <= TOL[k] for k in TOL) and all(control[k] > TOL[k] for k in TOL)
    tokens = x.shape[0] * x.shape[1]
    plans = _ffn_plans(sparse_blk, tokens, dtype)
    RESULTS["checks"].append({"block": name, "ok": ok, "rel": rels, "control_unmasked_rel": control, "plans": plans})
    used = [k for k, v in plans.items() if v["cusparselt"]]
    if dev.type == "cuda" and not used:
        RESULTS["notes"].append(f"check {name}: no FFN GEMM ran on cuSPARSELt (per-shape fallback); check is weak")
    print(
        f"check {name}: {'OK' if ok else 'FAIL'} rel { ({k: f'{v:.1e}' for k, v in rels.items()}) } "
        f"control { ({k: f'{v:.1e}' for k, v in control.items()}) } cuSPARSELt on {used or 'none'}",
        flush=True,
    )
    del ref, got, want, unmasked
    return ok


def time_window(block, mgr, opt, inp, dev, first: int, warmup: int, steps: int, interval: int) -> dict:
    """Warm-up then ``steps`` timed steps numbered from ``first``: mask refreshes fall where training has them."""
    for i in range(warmup):
        block_step(block, mgr, opt, inp, first + i, dev)
    _reset_peak(dev)
    rows = []
    for i in range(steps):
        s = first + warmup + i
        t, t_opt, refreshed = block_step(block, mgr, opt, inp, s, dev)
        rows.append((s, 1e3 * t, 1e3 * t_opt, refreshed))
    res = {"steps": [r[0] for r in rows], "ms": [r[1] for r in rows], "optimizer_ms": [r[2] for r in rows]}
    res["peak_gib"] = _peak_gib(dev)
    res["refresh_steps"] = [r[0] for r in rows if r[3]]
    by_step = {r[0]: r[1] for r in rows}
    # a refresh's cost lands on its step (mask search) and the next one (recompression inside the forward)
    hit = {s for s in res["refresh_steps"]} | {s + 1 for s in res["refresh_steps"]}
    steady = statistics.median([ms for s, ms in by_step.items() if s not in hit])
    excess = [by_step[s] + by_step[s + 1] - 2 * steady for s in res["refresh_steps"] if s + 1 in by_step]
    res["steady_ms"] = steady
    res["refresh_excess_ms"] = statistics.mean(excess) if excess else None
    res["amortised_ms"] = steady + (statistics.mean(excess) / interval if excess else 0.0)
    res["window_mean_ms"] = statistics.mean(res["ms"])
    res["optimizer_median_ms"] = statistics.median(res["optimizer_ms"])
    return res


def block_case(args, name: str, model_ov: list[str], dev: torch.device, dtype: torch.dtype) -> bool:
    cfg = make_cfg(args, model_ov)
    interval = cfg.sparsity.refresh_interval
    inp = block_inputs(cfg, args.block_batch, dev, dtype)
    tokens = inp[0].shape[0] * inp[0].shape[1]
    blk, mgr, opt = build_block(cfg, dev, dtype, True)
    ok = check_block(name, cfg, blk, mgr, opt, inp, dev, dtype)
    _free()
    sparse = time_window(blk, mgr, opt, inp, dev, 2, args.block_warmup, args.block_steps, interval)
    plans = _ffn_plans(blk, tokens, dtype)
    del blk, mgr, opt
    _free()
    blk, _, opt = build_block(cfg, dev, dtype, False)
    dense = time_window(blk, None, opt, inp, dev, 2, args.block_warmup, args.block_steps, interval)
    del blk, opt
    _free()
    if not sparse["refresh_steps"] or sparse["refresh_excess_ms"] is None:
        raise RuntimeError(f"block {name}: no complete mask refresh inside the timed window; raise --block-steps")
    m = cfg.model
    row = {
        "block": name, "hidden": m.hidden_size, "heads": m.num_attention_heads, "kv": m.kv_heads,
        "ffn": m.ffn_size, "seq": m.seq_length, "batch": args.block_batch, "tokens": tokens,
        "dense_ms": dense["steady_ms"], "sparse_ms": sparse["amortised_ms"],
        "speedup": dense["steady_ms"] / sparse["amortised_ms"],
        "sparse_steady_ms": sparse["steady_ms"], "refresh_excess_ms": sparse["refresh_excess_ms"],
        "optimizer_ms": dense["optimizer_median_ms"],
        "speedup_incl_optimizer": (dense["steady_ms"] + dense["optimizer_median_ms"])
        / (sparse["amortised_ms"] + sparse["optimizer_median_ms"]),
        "dense_peak_gib": dense["peak_gib"], "sparse_peak_gib": sparse["peak_gib"],
        "plans": plans, "dense": dense, "sparse": sparse,
    }  # fmt: skip
    RESULTS["block"].append(row)
    print(
        f"block {name}: dense {row['dense_ms']:.2f} ms, sparse {row['sparse_ms']:.2f} ms "
        f"({row['speedup']:.3f}x), refreshes at steps {sparse['refresh_steps']}",
        flush=True,
    )
    return ok


# ----------------------------------------------------------------------------------------------- end to end
def e2e_case(args, micro: int, sparse: bool) -> dict:
    extra = [f"train.micro_batch_size={micro}", f"train.global_batch_size={args.gbs}", f"sparsity.enabled={sparse}"]
    cfg = make_cfg(args, SMALL_BLOCKS["1b"] if args.small else [], extra)
    tr = Trainer(cfg, init_groups=False)
    dev = tr.device

    def step():
        _sync(dev)
        return tr.train_step()

    losses = [step().loss for _ in range(args.warmup)]
    _reset_peak(dev)
    times = []
    for _ in range(args.steps):
        r = step()
        losses.append(r.loss)
        times.append(1e3 * r.seconds)
    med = statistics.median(times)
    excess, refreshed_at = [], []
    if sparse:  # jump to just before a refresh step; time it and the next step (its forward recompresses)
        interval = cfg.sparsity.refresh_interval
        for _ in range(args.refreshes):
            nxt = (tr.step // interval + 1) * interval
            if nxt >= tr.sparsity.manager.switch_step:
                raise RuntimeError(f"refresh step {nxt} is inside the dense fine-tuning phase; raise train.steps")
            tr.step = nxt - 1
            r1, r2 = step(), step()
            if "flip_rate" not in r1.extra or not r2.extra.get("sparse"):
                raise RuntimeError(f"step {nxt} did not refresh masks sparsely: {r1.extra}")
            refreshed_at.append(nxt)
            losses += [r1.loss, r2.loss]
            excess.append(1e3 * (r1.seconds + r2.seconds) - 2 * med)
    step_ms = med + (statistics.mean(excess) / cfg.sparsity.refresh_interval if excess else 0.0)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    res = {
        "micro_batch_size": micro, "global_batch_size": cfg.train.global_batch_size, "sparse": sparse,
        "step_ms": step_ms, "steady_ms": med, "times_ms": times, "refresh_excess_ms": excess,
        "refreshed_at": refreshed_at, "tokens_per_s": tokens / (step_ms / 1e3), "peak_gib": _peak_gib(dev),
        "losses": losses, "finite": all(math.isfinite(x) for x in losses),
    }  # fmt: skip
    if sparse:  # every block has the same shapes: layer 0 stands for all
        res["plans_layer0"] = _ffn_plans(tr.model.layers[0], micro * cfg.model.seq_length, tr.compute_dtype)
    return res


def e2e(args) -> bool:
    ok = True
    for micro in [int(x) for x in args.micro.split(",")]:
        pair = {}
        for sparse in (False, True):
            try:
                pair[sparse] = e2e_case(args, micro, sparse)
                ok &= pair[sparse]["finite"]
            except Exception as e:  # an OOM or a failing path is itself a result; keep the other cases
                traceback.print_exc()
                RESULTS["notes"].append(f"e2e mb={micro} sparse={sparse}: {type(e).__name__}: {str(e)[:300]}")
                ok = False
            _free()  # outside the except: its traceback would keep the failed case's trainer alive
        if len(pair) == 2:
            d, s = pair[False], pair[True]
            row = {"micro_batch_size": micro, "global_batch_size": args.gbs, "dense": d, "sparse": s}
            row["speedup"] = d["step_ms"] / s["step_ms"]
            RESULTS["e2e"].append(row)
            print(f"e2e mb={micro}: dense {d['step_ms']:.1f} ms, sparse {s['step_ms']:.1f} ms", flush=True)
    return ok


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "bench_sparse24_block.json"))
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU, emulate backend (smoke test)")
    p.add_argument("--backend", default="auto", help="sparsity.backend for the sparse runs")
    p.add_argument("--blocks", default=",".join(BLOCKS), help=f"subset of {list(BLOCKS)}")
    p.add_argument("--block-batch", type=int, default=4, help="micro-batch of the block runs ([s, b, h])")
    p.add_argument("--block-warmup", type=int, default=5)
    p.add_argument("--block-steps", type=int, default=80, help="timed block steps (two refreshes at 40)")
    p.add_argument("--micro", default="1,2,4", help="end-to-end micro-batch sizes")
    p.add_argument("--gbs", type=int, default=8, help="end-to-end global batch (sequences)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--refreshes", type=int, default=2, help="mask-refresh steps timed per sparse e2e case")
    p.add_argument("--skip-e2e", action="store_true")
    a = p.parse_args(argv)
    if a.small:
        a.block_batch, a.block_warmup, a.block_steps = 2, 2, 40
        a.micro, a.gbs, a.warmup, a.steps, a.refreshes = "1", 2, 1, 2, 1
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.small and not torch.cuda.is_available():
        print("bench_sparse24_block: needs a CUDA GPU (or --small for the CPU smoke run)", file=sys.stderr)
        return 2
    state.init(1, 1, False, "auto")
    dev = torch.device("cpu") if args.small else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.small else torch.bfloat16
    RESULTS["device"] = "cpu" if args.small else torch.cuda.get_device_name(dev)
    RESULTS["torch"] = torch.__version__
    RESULTS["args"] = vars(args)
    print(RESULTS["device"], "torch", torch.__version__, flush=True)
    ok = True
    blocks = SMALL_BLOCKS if args.small else BLOCKS
    for name in args.blocks.split(","):
        try:
            ok &= block_case(args, name, blocks[name], dev, dtype)
        except Exception as e:
            traceback.print_exc()
            RESULTS["notes"].append(f"block {name}: {type(e).__name__}: {str(e)[:300]}")
            ok = False
        _free()
    if not args.skip_e2e:
        ok &= e2e(args)
    RESULTS["ok"] = bool(ok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print(format_table(RESULTS), flush=True)
    state.destroy()
    return 0 if ok else 1


def _table(title: str, cols: list[tuple[str, str, Callable[[dict], object]]], rows: list[dict]) -> list[str]:
    """Columns as (header, format spec, getter); first column left-aligned, the rest right-aligned."""
    cells = [[format(get(r), spec) for _, spec, get in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(cols)]

    def line(items: list[str]) -> str:
        return " ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(items, widths)))

    head = line([h for h, _, _ in cols])
    return [title, head, "-" * len(head)] + [line(c) for c in cells]


def _excess(e: dict) -> float:
    x = e["sparse"]["refresh_excess_ms"]
    return statistics.mean(x) if x else float("nan")


BLOCK_COLS = [
    ("block", "", lambda b: b["block"]), ("h", "d", lambda b: b["hidden"]), ("ffn", "d", lambda b: b["ffn"]),
    ("tokens", "d", lambda b: b["tokens"]), ("dense ms", ".2f", lambda b: b["dense_ms"]),
    ("sparse ms", ".2f", lambda b: b["sparse_ms"]), ("speedup", ".3f", lambda b: b["speedup"]),
    ("refresh+ ms", ".2f", lambda b: b["refresh_excess_ms"]), ("optim ms", ".2f", lambda b: b["optimizer_ms"]),
    ("x incl optim", ".3f", lambda b: b["speedup_incl_optimizer"]),
    ("GiB dense", ".1f", lambda b: b["dense_peak_gib"]), ("GiB sparse", ".1f", lambda b: b["sparse_peak_gib"]),
]  # fmt: skip
E2E_COLS = [
    ("mb", "d", lambda e: e["micro_batch_size"]), ("gbs", "d", lambda e: e["global_batch_size"]),
    ("dense ms", ".1f", lambda e: e["dense"]["step_ms"]), ("sparse ms", ".1f", lambda e: e["sparse"]["step_ms"]),
    ("speedup", ".3f", lambda e: e["speedup"]), ("tok/s dense", ".0f", lambda e: e["dense"]["tokens_per_s"]),
    ("tok/s sparse", ".0f", lambda e: e["sparse"]["tokens_per_s"]), ("refresh+ ms", ".1f", _excess),
    ("GiB dense", ".1f", lambda e: e["dense"]["peak_gib"]), ("GiB sparse", ".1f", lambda e: e["sparse"]["peak_gib"]),
]  # fmt: skip


def format_table(r: dict) -> str:
    lines = [f"\n2:4 sparse FFN: block and trainer step | {r['device']} | torch {r['torch']}"]
    lines += [f"note: {n}" for n in r["notes"]]
    for c in r["checks"]:
        worst = max(c["rel"].values())
        used = ",".join(k for k, v in c["plans"].items() if v["cusparselt"]) or "none"
        lines.append(f"check {c['block']:<10} {'OK' if c['ok'] else 'FAIL'} worst rel {worst:.1e} cuSPARSELt: {used}")
    title = "block fwd+bwd+sparsity hooks (sparse: steady + refresh excess / 40; optimizer step apart)"
    lines += _table(title, BLOCK_COLS, r["block"])
    title = "trainer step, configs/gpu_1b_1gpu.yaml, synthetic (sparse: median + refresh excess / 40)"
    lines += _table(title, E2E_COLS, r["e2e"])
    lines.append(f"speedup = dense ms / sparse ms (> 1: sparse faster); overall {'OK' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
