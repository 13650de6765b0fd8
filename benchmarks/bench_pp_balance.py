"""Pipeline last-stage balance: vocabulary layers over the pipeline against the vocabulary on the last stage.

    torchrun --nproc_per_node P benchmarks/bench_pp_balance.py CONFIG.yaml [section.key=value ...] \\
        [--cases last,planned,vocab_pp] [--warmup 2] [--steps 5] [--out runs/bench_pp_balance.json]

Cases, all in one process group and one call:

* ``last``: the configured (or even) layer split with the embedding on the first stage and the output
  layer on the last (Megatron's default layout, the anchor);
* ``planned``: same, with the split ``megasparse plan`` recommends for it (a fairer anchor: it moves layers
  off the last stage to pay for the loss);
* ``vocab_pp``: ``loss.vocab_over_pp=true`` (output layer and input embedding sharded over every stage) with
  its planned split.

``NAME:12-14`` runs case NAME with an explicit layer split instead of the planned one.

Per stage it reports the step's GPU busy time (sum of non-communication kernel durations of one profiled
step: what a stage computes, without the time it waits for its neighbours) and the peak allocated memory;
both as the largest deviation from the stage mean. With ``train.cuda_graphs=false`` it also splits out the
backward's share (``bwd_busy_ms_per_stage``: kernels launched from autograd's thread), which is how issue 6 reads
backward time per stage with and without filtering (``--cases last filter.mode=...``). Step time is wall
clock (the slowest rank, median of ``--steps``); the throughput gain is the anchor's step time over the case's.
On CPU (gloo) busy time is not measured (nan): the CPU run only checks that the cases run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import _free, _peak_gib, _reset_peak, _sync, gather_floats, log0  # noqa: E402

from megasparse.config import Config, ConfigError, load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.parallel import planner, state  # noqa: E402
from megasparse.train import Trainer  # noqa: E402

CASES = ("last", "planned", "vocab_pp")


def case_overrides(path: str, overrides: list[str], case: str) -> list[str]:
    """Dotted overrides that turn the benchmark's config into ``case``."""
    name, _, explicit = case.partition(":")
    if name == "last":
        return ["loss.vocab_over_pp=false"]
    vpp = name == "vocab_pp"
    flag = f"loss.vocab_over_pp={str(vpp).lower()}"
    if explicit:
        split = [int(x) for x in explicit.split("-")]
    else:
        split = planner.best_split(load_config(path, overrides + [flag]), vpp, dp=state.layout().dp)
    return [flag, f"parallel.layer_split=[{','.join(map(str, split))}]"]


def busy_ms(step, dev: torch.device) -> tuple[float, float]:
    """(GPU time of one step in kernels other than NCCL's, the part of it the backward launched); nan on CPU.

    The backward's kernels are those launched from autograd's device thread, not from the thread that called the
    step. A replayed CUDA graph launches forward and backward alike from the calling thread, so the split needs an
    eager step (``train.cuda_graphs=false``; the kernels are the same) and reads 0 otherwise."""
    if dev.type != "cuda":
        step()
        return float("nan"), float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("bench.step"):
            step()
        _sync(dev)
    events = prof.events()
    main = next(e.thread for e in events if e.name == "bench.step" and e.device_type == DeviceType.CPU)
    # user annotations (the step's own range among them) also show on the GPU timeline, spanning what they enclose
    total = sum(
        e.time_range.elapsed_us()
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name != "bench.step"
        and "nccl" not in e.name.lower()
    )
    backward = sum(
        k.duration
        for e in events
        if e.device_type == DeviceType.CPU and e.thread != main
        for k in e.kernels
        if "nccl" not in k.name.lower()
    )
    return total / 1e3, backward / 1e3


def run_case(cfg: Config, warmup: int, steps: int) -> dict:
    tr = Trainer(cfg, init_groups=False)
    dev = tr.device
    for _ in range(warmup):
        tr.train_step()
    _sync(dev)
    _reset_peak(dev)
    times, losses = [], []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        r = tr.train_step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(r.loss)
    mem = _peak_gib(dev)
    busy, bwd = busy_ms(tr.train_step, dev)
    if tr.graphs.blocker is None:  # captured: the split is not visible (busy_ms)
        bwd = float("nan")
    out = {
        "split": list(tr.model.layer_ids),
        "times": times,
        "mem_gib": mem,
        "busy_ms": busy,
        "bwd_ms": bwd,
        "losses": losses,
        "params_m": sum(p.numel() for p in tr.model.parameters()) / 1e6,
    }
    del tr
    _free()
    return out


def spread(xs: list[float]) -> float:
    """Largest deviation from the mean, as a fraction of the mean."""
    m = statistics.fmean(xs)
    return max(abs(x - m) for x in xs) / m if m else float("nan")


def summarize(case: str, overrides: list[str], cfg: Config, per_rank: list[dict]) -> dict:
    lay = state.layout()
    # one value per stage: the first TP/DP rank of each stage stands for it
    stage_rank = {r["pp_rank"]: r for r in per_rank if r["tp_rank"] == 0 and r["dp_rank"] == 0}
    stages = [stage_rank[p] for p in range(lay.pp)]
    step_s = max(statistics.median(r["times"]) for r in per_rank)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    busy = [s["busy_ms"] for s in stages]
    bwd = [s["bwd_ms"] for s in stages]
    mem = [s["mem_gib"] for s in stages]
    return {
        "case": case,
        "overrides": overrides,
        "layers_per_stage": [s["layers"] for s in stages],
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens / step_s,
        "busy_ms_per_stage": busy,
        "busy_spread": spread(busy),
        "bwd_busy_ms_per_stage": bwd,
        "mem_gib_per_stage": mem,
        "mem_spread": spread(mem),
        "params_m_per_stage": [s["params_m"] for s in stages],
        "final_loss": per_rank[-1]["losses"][-1],
    }


def format_table(rows: list[dict], device: str, layout: str) -> str:
    anchor = next((r for r in rows if r["case"] == "last"), rows[0])
    head = (
        f"{'case':<14} {'layers':<10} {'step ms':>9} {'tok/s':>9} {'gain':>6} {'busy ms per stage':<22} "
        f"{'±busy':>6} {'peak GiB per stage':<20} {'±mem':>6}"
    )
    lines = [f"pipeline balance | {device} | {layout}", head, "-" * len(head)]
    for r in rows:
        busy = "/".join(f"{x:.0f}" for x in r["busy_ms_per_stage"])
        mem = "/".join(f"{x:.1f}" for x in r["mem_gib_per_stage"])
        lines.append(
            f"{r['case']:<14} {str(r['layers_per_stage']):<10} {r['step_ms']:9.1f} {r['tokens_per_s']:9.0f} "
            f"{anchor['step_ms'] / r['step_ms']:6.3f} {busy:<22} {100 * r['busy_spread']:5.1f}% {mem:<20} "
            f"{100 * r['mem_spread']:5.1f}%"
        )
        bwd = r.get("bwd_busy_ms_per_stage", [])
        if bwd and all(math.isfinite(x) for x in bwd):
            lines.append(f"{'':<14} backward busy ms per stage: {'/'.join(f'{x:.1f}' for x in bwd)}")
    lines.append(
        "busy: non-NCCL kernel time of one step per stage (backward: what autograd's thread launched, eager steps "
        "only); ±: largest deviation from the stage mean; gain: step time of 'last' / case's"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "bench_pp_balance.json"))
    a = parse_with_overrides(p, list(sys.argv[1:] if argv is None else argv))
    cases = [c for c in a.cases.split(",") if c]
    world = state.world_env()[1]
    try:
        if any(c.partition(":")[0] not in CASES for c in cases):
            raise ConfigError(f"--cases {a.cases!r}: use a comma list of {', '.join(CASES)} (NAME:12-14 for a split)")
        base = load_config(a.config, list(a.overrides))
        base.validate(world)
        if base.parallel.pp < 2:
            raise ConfigError(f"parallel.pp={base.parallel.pp}: the balance benchmark needs parallel.pp >= 2")
    except ConfigError as e:
        print(f"bench_pp_balance: error: {e}", file=sys.stderr)
        return 2
    par = base.parallel
    state.init(par.tp, par.pp, par.sequence_parallel, par.backend)
    lay = state.layout()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = f"{world}x {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"{world}x cpu"
    layout = (
        f"{Path(a.config).stem} tp={par.tp} pp={par.pp} seq={base.model.seq_length} "
        f"mb={base.train.micro_batch_size} gbs={base.train.global_batch_size} torch {torch.__version__}"
    )
    rows = []
    for case in cases:
        ov = case_overrides(a.config, list(a.overrides), case)
        cfg = load_config(a.config, list(a.overrides) + ov)
        cfg.validate(world)
        log0(f"--- {case}: {' '.join(ov)} ---")
        r = run_case(cfg, a.warmup, a.steps)
        ids = [float(lay.pp_rank), float(lay.tp_rank), float(lay.dp_rank), float(len(r["split"]))]
        vals = [r["mem_gib"], r["busy_ms"], r["bwd_ms"], r["params_m"], r["losses"][-1]]
        flat = gather_floats(ids + vals + r["times"], dev)
        per_rank = [
            dict(pp_rank=int(x[0]), tp_rank=int(x[1]), dp_rank=int(x[2]), layers=int(x[3]), mem_gib=x[4],
                 busy_ms=x[5], bwd_ms=x[6], params_m=x[7], losses=[x[8]], times=x[9:])
            for x in flat
        ]  # fmt: skip
        row = summarize(case, ov, cfg, per_rank)
        rows.append(row)
        log0(
            f"{case}: {row['step_ms']:.1f} ms/step, busy per stage {[round(x, 1) for x in row['busy_ms_per_stage']]}, "
            f"peak GiB {[round(x, 2) for x in row['mem_gib_per_stage']]}, loss {row['final_loss']:.4f}"
        )
    table = format_table(rows, device, layout)
    if torch.distributed.get_rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        report = {"device": device, "layout": layout, "config": a.config, "overrides": a.overrides, "cases": rows}
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(table, flush=True)
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
