"""Trainer step time, throughput, MFU and memory: megasparse's Trainer against megatron-core's GPTModel.

    torchrun --nproc_per_node N benchmarks/bench_trainer.py CONFIG.yaml [section.key=value ...] \\
        [--micro 1,2] [--impls megasparse,mcore-sdpa,mcore-local] [--warmup 2] [--steps 5] \\
        [--out runs/bench_trainer.json] [--profile runs/bench_trainer_profile.txt]

Anchor: megatron-core 0.16 GPTModel on the local spec (benchmarks/mcore_anchor.py) with the same TP/PP/SP
layout, micro/global batch and shapes, stepped by megatron-core's get_forward_backward_func() and its
optimizer, in the same process group and call. Before timing (when pp == 1) megasparse's initial weights
are copied into each megatron-core variant and the per-token losses of one micro-batch are compared, so
the anchor is known to compute the same model. Each case then runs warm-up steps and synchronised timed
steps; per-rank medians are gathered, and the table (last) reports the slowest rank. Throughput and
TFLOP/s use megasparse.metrics.flops_per_token (6·N + 12·L·h·s). ``--profile`` writes a
torch.profiler table of one step per implementation (rank 0, top 15 ops by self CUDA time).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script from the repository root (benchmarks/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megasparse.config import Config, ConfigError, load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.data.dataset import batch_iterator, build_data  # noqa: E402
from megasparse.metrics import flops_per_token, peak_tflops  # noqa: E402
from megasparse.parallel import comm, state  # noqa: E402
from megasparse.train import Trainer  # noqa: E402

IMPLS = ("megasparse", "mcore-sdpa", "mcore-local")


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def warmup_steps(cfg, warmup: int) -> int:
    """Steps to run before timing: 2:4 with backend=auto times sparse against dense GEMMs over its first steps
    (``GemmAutotune.STEPS_NEEDED``, converter.py), which must not be among the timed ones."""
    from megasparse.sparse24.converter import GemmAutotune

    if cfg.sparsity.enabled and cfg.sparsity.backend == "auto":
        return max(warmup, GemmAutotune.STEPS_NEEDED)
    return warmup


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


LEFTOVER_NOTE_GIB = 1.0
"""Memory earlier cases left allocated above which a case names what holds it and its row is marked."""


def live_cuda_tensors(top: int = 6) -> str:
    """The largest CUDA tensors the garbage collector can still reach, and what holds each: a whole-8B dense case
    leaves about its stage's bf16 weights allocated into the next case (reports/2026-11-27-4gpu-split-seq8192.md)."""
    import warnings

    found, storages = [], {}
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if not (isinstance(o, torch.Tensor) and o.is_cuda):
                    continue
                st = o.untyped_storage()
                ptr, size = st.data_ptr(), st.nbytes()
            except Exception:  # noqa: BLE001 - refuses isinstance, or no storage of its own (DTensor, Float8Tensor)
                continue
            if ptr:  # a FakeTensor (torch.compile's caches) reads 0: it holds no memory
                found.append((size, o))
                storages[ptr] = size
    found.sort(key=lambda x: -x[0])
    found = [t for _, t in found]
    total = sum(storages.values()) / 2**30
    rows = []
    for t in found[:top]:
        holders = sorted({type(r).__name__ for r in gc.get_referrers(t) if r is not found})
        rows.append(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} held by {','.join(holders) or '?'}")
    return f"{len(found)} reachable tensors, {total:.2f} GiB: " + "; ".join(rows)


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def graph_pool_gib(dev: torch.device) -> tuple[float, float]:
    """(reserved, allocated) GiB in CUDA-graph private memory pools.

    A captured graph's activations are freed in the allocator's books when its capture ends, yet the pool keeps
    them for every replay: ``max_memory_allocated`` misses them."""
    if dev.type != "cuda":
        return 0.0, 0.0
    segs = torch.cuda.memory._snapshot(dev)["segments"]
    segs = [s for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]  # (0, 0): the default pool
    return sum(s["total_size"] for s in segs) / 2**30, sum(s["allocated_size"] for s in segs) / 2**30


def _peak_gib(dev: torch.device) -> float:
    """Peak memory a step holds: the allocator's peak, with graph pools counted at their reserved size (what lives in
    them is constant over replays, so the peak's share of them is what is allocated there now)."""
    if dev.type != "cuda":
        return float("nan")
    reserved, allocated = graph_pool_gib(dev)
    return torch.cuda.max_memory_allocated(dev) / 2**30 - allocated + reserved


def optimizer_state_gib(opt) -> float:
    """fp32 master weights and Adam moments an optimizer holds on this rank, measured from its tensors' storages.

    Walks wrappers (megatron-core's chained optimizers, megasparse's data-parallel and distributed optimizers) down
    to their torch optimizers and counts each distinct fp32 tensor of their parameters and state once."""
    found: list[torch.optim.Optimizer] = []
    todo, seen_obj = [opt], set()
    while todo:
        o = todo.pop()
        if o is None or id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.optim.Optimizer):
            found.append(o)
            continue
        todo += list(getattr(o, "chained_optimizers", []))
        todo += [getattr(o, name, None) for name in ("optimizer", "inner")]
    held: dict[tuple[int, int], int] = {}  # (address, numel): views (shards of one flat buffer) count as themselves
    for o in found:
        for g in o.param_groups:
            for p in g["params"]:
                for t in [p, *(v for v in o.state.get(p, {}).values() if torch.is_tensor(v))]:
                    if t.dtype == torch.float32 and t.numel() > 1:
                        held[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(held.values()) / 2**30


def gather_floats(values: list[float], dev: torch.device) -> list[list[float]]:
    """Every rank's list (equal lengths) on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = comm.all_gather(t[None], None, "world", dim=0, region="bench.gather")
    return out.tolist()


def profile_table(step, dev: torch.device, label: str) -> str:
    """One step under torch.profiler; the top 15 ops by self device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(dev)
    ka = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if dev.type == "cuda" else ()
    for key in keys + ("self_cpu_time_total",):
        try:
            table = ka.table(sort_by=key, row_limit=15, max_name_column_width=60)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    return f"==== {label} (rank {dist.get_rank() if dist.is_initialized() else 0}) ====\n{table}\n"


def mcore_data(cfg: Config, ds, dev: torch.device):
    """The micro-batches megasparse's trainer draws ([b, s+1] tokens from step 0 on), moved to ``dev``."""
    lay = state.layout()
    for x in batch_iterator(ds, cfg.train.micro_batch_size, lay.dp_rank, lay.dp, 0):
        yield x.to(dev, non_blocking=True)


def equivalence_check(cfg: Config, impls: list[str]) -> dict:
    """megasparse's initial weights into each mcore variant; compare one micro-batch's per-token losses.

    At initialisation every loss is near ln(V), so the mean alone would pass a wrong weight layout; the
    error is measured on the per-token deviations from the mean: ‖a − b‖ / ‖a − mean(a)‖.
    """
    import mcore_anchor

    res: dict = {}
    tr = Trainer(cfg, init_groups=False)
    tok = next(mcore_data(cfg, tr.train_ds, tr.device))
    with torch.no_grad():
        ours = tr.model(tok[:, :-1].t().contiguous(), tok[:, 1:].t().reshape(-1)).double()
    res["megasparse"] = {"mean_loss": ours.mean().item()}
    for impl in impls:
        if not impl.startswith("mcore"):
            continue
        try:
            gpt, inner, _ = mcore_anchor.build_gpt(cfg, tr.vocab_padded, impl.split("-")[1], tr.compute_dtype)
            mcore_anchor.load_from_megasparse(inner, tr.model)
            with torch.no_grad():
                theirs = mcore_anchor.token_loss(gpt, tok).double().t().reshape(-1)  # [b, s] -> s-major
            err = ((theirs - ours).norm() / (ours - ours.mean()).norm()).item()
            res[impl] = {"mean_loss": theirs.mean().item(), "centered_rel_err": err}
            del gpt, inner
        except Exception as e:  # report and carry on with the other variants
            res[impl] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        _free()
    del tr
    _free()
    if "mcore-local" in impls:
        mcore_anchor.reset_memory_buffer()
    return res


def run_case(cfg: Config, impl: str, warmup: int, steps: int, profile: bool, after=None) -> dict:
    """Build one implementation, warm up, time ``steps`` steps; per-rank step seconds and peak memory.

    ``after(step)``, if given, runs once after the timed steps with the built step function; its result is
    returned under "after" (bench_e2e counts host synchronisations that way)."""
    import mcore_anchor

    _free()
    # what earlier cases left allocated (megatron-core's anchor leaves ~10 GiB behind on TinyLlama): not this case's
    leftover = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    if leftover > LEFTOVER_NOTE_GIB:
        print(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: {leftover:.2f} GiB left allocated by earlier "
            f"cases; {live_cuda_tensors()}",
            flush=True,
        )
    if impl == "megasparse":
        tr = Trainer(cfg, init_groups=False)
        dev = tr.device

        def step():
            _sync(dev)
            r = tr.train_step()
            return r.loss, r.seconds

        keep = tr
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        train_ds, _, vocab = build_data(cfg)
        mt = mcore_anchor.McoreTrainer(
            cfg,
            cfg.padded_vocab(vocab),
            lambda: mcore_data(cfg, train_ds, dev),
            cfg.num_microbatches(state.layout().dp),
            impl.split("-")[1],
        )
        keep = mt
        step = mt.train_step
    losses, times = [], []
    for _ in range(warmup):
        loss, _ = step()
        losses.append(loss)
    _reset_peak(dev)
    for _ in range(steps):
        loss, sec = step()
        losses.append(loss)
        times.append(sec)
    mem = _peak_gib(dev) - leftover
    pools = graph_pool_gib(dev)[0]
    optim_gib = optimizer_state_gib(keep.dp_opt if impl == "megasparse" else keep.optimizer)
    prof = profile_table(step, dev, f"{impl} mb={cfg.train.micro_batch_size}") if profile else ""
    extra = after(step) if after is not None else None
    if getattr(keep, "graphs", None) is not None:  # a captured step's memory pool outlives the trainer otherwise
        keep.graphs.release()
    del keep, step
    _free()
    if impl == "mcore-local":
        mcore_anchor.reset_memory_buffer()
    return {
        "times": times,
        "mem_gib": mem,
        "graph_pool_gib": pools,
        "optim_state_gib": optim_gib,
        "leftover_gib": leftover,
        "losses": [x for x in losses if x is not None],
        "profile": prof,
        "after": extra,
    }


def summarize(
    cfg: Config, impl: str, vocab_padded: int, per_rank_times: list[list[float]], mems: list[float], world: int
) -> dict:
    med = [statistics.median(t) for t in per_rank_times]
    step_s = max(med)
    m = cfg.model
    tokens = cfg.train.global_batch_size * m.seq_length
    tok_s_gpu = tokens / step_s / world
    tflops = tok_s_gpu * flops_per_token(m, vocab_padded) / 1e12
    peak = peak_tflops(torch.device("cuda")) if torch.cuda.is_available() else None
    return {
        "impl": impl,
        "micro_batch_size": cfg.train.micro_batch_size,
        "global_batch_size": cfg.train.global_batch_size,
        "step_ms": 1e3 * step_s,
        "step_ms_per_rank": [1e3 * x for x in med],
        "step_ms_spread": 1e3 * (max(max(t) for t in per_rank_times) - min(min(t) for t in per_rank_times)),
        "tokens_per_s_per_gpu": tok_s_gpu,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "mem_gib_max_rank": max(mems),
        "mem_gib_per_rank": mems,
    }


def cell(case: dict, key: str, spec: str) -> str:
    """One table cell: ``case[key]`` formatted by ``spec``, or a right-aligned "-" of the spec's width when absent."""
    x = case.get(key)
    return format(x, spec) if x is not None else f"{'-':>{spec.split('.')[0]}}"


def format_table(rows: list[dict], device: str, layout: str) -> str:
    head = (
        f"{'impl':<12} {'mb':>3} {'step ms':>9} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} "
        f"{'vs sdpa':>8} {'vs local':>8}"
    )
    lines = [f"trainer benchmark | {device} | {layout}", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r['micro_batch_size']:>3} {r['error'][:80]}")
            continue
        ratios = []
        for anchor in ("mcore-sdpa", "mcore-local"):
            a = next((x for x in rows if x["impl"] == anchor and x["micro_batch_size"] == r["micro_batch_size"]), None)
            ok = a is not None and "error" not in a
            ratios.append(f"{r['step_ms'] / a['step_ms']:8.3f}" if ok else f"{'-':>8}")
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else f"{'-':>6}"
        lines.append(
            f"{r['impl']:<12} {r['micro_batch_size']:>3} {r['step_ms']:9.1f} {r['tokens_per_s_per_gpu']:10.0f} "
            f"{r['tflops_per_gpu']:8.1f} {mfu} {r['mem_gib_max_rank']:8.2f} {ratios[0]} {ratios[1]}"
        )
    lines.append("ratios: step time / anchor's step time at the same micro-batch (< 1: megasparse faster)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.prefix=synthetic")
    p.add_argument("--micro", default=None, help="comma-separated micro-batch sizes (default: the config's)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-check", action="store_true", help="skip the weight-copy loss equivalence check")
    p.add_argument("--check-tol", type=float, default=0.1, help="max centered relative loss error (bf16)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "bench_trainer.json"))
    p.add_argument("--profile", default=None, help="write per-implementation profiler tables here")
    return parse_with_overrides(p, argv)  # key=value anywhere on the line


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    impls = [x for x in a.impls.split(",") if x]
    bad = [x for x in impls if x not in IMPLS]
    if bad:
        print(f"bench_trainer: unknown --impls {bad}; use {IMPLS}", file=sys.stderr)
        return 2
    micro_ov = [f"train.micro_batch_size={a.micro.split(',')[0]}"] if a.micro else []
    world = state.world_env()[1]
    try:
        base = load_config(a.config, list(a.overrides) + micro_ov)
        base.validate(world)
    except ConfigError as e:
        print(f"bench_trainer: error: {e}", file=sys.stderr)
        return 2
    p = base.parallel
    state.init(p.tp, p.pp, p.sequence_parallel, p.backend)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device_name = f"{world}x {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"{world}x cpu"
    layout = (
        f"{Path(a.config).stem} tp={p.tp} pp={p.pp}{' +SP' if p.sequence_parallel else ''} "
        f"seq={base.model.seq_length} gbs={base.train.global_batch_size} "
        f"torch {torch.__version__}"
    )
    vocab_padded = base.padded_vocab(build_data(base)[2])
    micros = [int(x) for x in a.micro.split(",")] if a.micro else [base.train.micro_batch_size]
    report: dict = {"device": device_name, "layout": layout, "config": a.config, "overrides": a.overrides}
    report["cases"], report["checks"] = [], []
    profiles = []
    ok = True
    for mb in micros:
        cfg = load_config(a.config, list(a.overrides) + [f"train.micro_batch_size={mb}"])
        cfg.validate(world)
        if not a.no_check and p.pp == 1 and mb == micros[0] and any(i.startswith("mcore") for i in impls):
            chk = equivalence_check(cfg, impls)
            for k, v in chk.items():
                err = v.get("centered_rel_err")
                good = k == "megasparse" or (err is not None and err <= a.check_tol)
                ok &= good
                log0(f"check mb={mb}: {k:<12} {v} {'' if good else 'MISMATCH'}")
            report["checks"].append({"micro_batch_size": mb, "initial_loss": chk})
        for impl in impls:
            log0(f"--- {impl} micro_batch_size={mb} ---")
            try:
                r = run_case(cfg, impl, a.warmup, a.steps, a.profile is not None)
                _free()
            except Exception as e:  # keep going: an OOM or a missing fused kernel is itself a result
                traceback.print_exc()
                _free()
                report["cases"].append({"impl": impl, "micro_batch_size": mb, "error": f"{type(e).__name__}: {e}"})
                ok = False
                continue
            times = gather_floats(r["times"], dev)
            mems = [x[0] for x in gather_floats([r["mem_gib"]], dev)]
            row = summarize(cfg, impl, vocab_padded, times, mems, world)
            row["losses_rank"] = r["losses"]
            finite = all(math.isfinite(x) for x in r["losses"])
            ok &= finite
            report["cases"].append(row)
            profiles.append(r["profile"])
            log0(
                f"{impl} mb={mb}: {row['step_ms']:.1f} ms/step, "
                f"per rank {[round(x, 1) for x in row['step_ms_per_rank']]}"
                f", mem {row['mem_gib_max_rank']:.2f} GiB, losses {[round(x, 4) for x in r['losses']]}"
            )
    table = format_table(report["cases"], device_name, layout)
    report["table"] = table
    report["ok"] = ok
    if a.profile:
        # every rank writes its own table: under PP the stages' op mixes differ
        prof_path = Path(a.profile)
        if world > 1:
            prof_path = prof_path.with_name(f"{prof_path.stem}.rank{dist.get_rank()}{prof_path.suffix}")
        prof_path.parent.mkdir(parents=True, exist_ok=True)
        prof_path.write_text("".join(profiles))
    if dist.get_rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(table, flush=True)
    state.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
