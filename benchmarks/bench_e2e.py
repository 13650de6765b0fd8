"""The end-to-end speed matrix: megasparse with each acceleration against megatron-core dense, one call per layout.

    torchrun --nproc_per_node N benchmarks/bench_e2e.py LAYOUT [--micro 1,2,4] [--modes dense,collider,...]
        [--anchors mcore-sdpa,torchtitan-bf16,torchtitan-fp8] [--steps 4] [--warmup 2] [--out-dir DIR] [--append]
        [section.key=value ...]
    python benchmarks/bench_e2e.py --plot docs/benchmarks/data/e2e_LAYOUT.json     # the PNG, on any machine
    python benchmarks/bench_e2e.py --plot-throughput A.json B.json --png docs/img/X.png  # tokens/s/GPU, anchors too

A layout's code path can be smoke-tested without GPUs: with ``train.device=cpu parallel.backend=gloo
train.dtype=fp32`` and tiny model overrides every megasparse mode runs on gloo ranks (the anchor needs CUDA and is
marked skipped; CPU times mean nothing).

Why this file is long: it is the matrix's one driver (layouts, modes, anchors, the case loop, the JSON with its
merge and ratios, the table and the plot); the anchors themselves live in mcore_anchor.py and titan_anchor.py.

Layouts (``LAYOUTS``): ``1gpu_tinyllama`` (22 layers), ``2gpu_8b_tp2sp`` and ``4gpu_8b_tp2pp2sp`` (Llama-3-8B-shaped
layers, 8 of them), ``4gpu_tinyllama_tp2pp2sp``, ``1gpu_8b4l`` (4 Llama-3-8B-shaped layers with the 8B vocabulary
on one GPU, where no multi-GPU machine is lent), and the pipeline halves of the 4-GPU layouts on two GPUs,
``2gpu_8b_pp2`` and ``2gpu_tinyllama_pp2`` (PP=2, no TP), and ``2gpu_8b_dp2`` (DP=2 with the distributed optimizer: its
fused AdamW and 2:4 pieces where no 4-GPU machine is lent). Issue 33's real workload, the whole Llama-3-8B (32
layers, seq 4096, global batch 32) on 4 GPUs: ``4gpu_8b32l`` (TP=2 × PP=2 + SP) and the same model as
``4gpu_8b32l_tp2sp_dp2``, ``4gpu_8b32l_pp2_dp2``, ``4gpu_8b32l_pp2v2_dp2`` (interleaved, 2 model chunks per rank,
selective recompute, 14/18 layers: for micro-batch 2) and ``4gpu_8b32l_dp4`` (distributed optimizer), each its own
JSON.
In each, for every micro-batch size: the anchors of ``--anchors`` — megatron-core's GPTModel with flash attention
(``mcore-sdpa``, ``benchmarks/mcore_anchor.py``, the anchor of ``vs mcore``) and torchtitan 0.2.2's own trainer
with compile, bf16 and float8 (``torchtitan-bf16``, ``torchtitan-fp8``, ``benchmarks/titan_anchor.py``: FSDP over
every GPU; by default on ``1gpu_8b4l`` and ``4gpu_8b32l`` only) — and megasparse in every mode of ``MODES`` (or
those of ``--modes``, which also takes ``EXTRA_MODES``: the dense step with the loss pinned), same shapes, same
global batch, same process group and call. A mode whose config does not validate on this checkout (``fp8``,
``collider+fp8`` and ``all four`` need ``train.fp8``) is reported as an error row and the rest runs.
``dense/eager`` and ``collider/eager`` run with ``train.cuda_graphs=false`` (what the captured step saves). Each
case warms up, then times synchronised steps (median over steps, slowest rank). ``host_syncs_per_step`` counts,
over one extra step, the synchronisations
``torch.cuda.set_sync_debug_mode("warn")`` reports (values read on the host: ``.item()``, ``nonzero``, copies to
the host); the explicit end-of-step ``torch.cuda.synchronize`` of both trainers is not among them.

Filtering runs with ``filter.scorer=loss`` (no reference model on the benchmark machine: the selection and the
compact backward cost the same with any scorer). MFU counts the dense model's FLOPs for every mode
(``megasparse.metrics.flops_per_token``), so a faster accelerated step shows as higher MFU; ``mfu_titan_formula``
is torchtitan's count (``titan_anchor.titan_flops_per_token``: equal for these models but for the final norm).

Writes ``e2e_<layout>.json`` (``device``, ``layout``, ``cases``: mode, micro_batch_size, step_ms, anchor_step_ms,
ratio_vs_anchor, ratio_vs_dense, ratio_vs_titan_bf16/fp8, mfu, mem_gib (peak per GPU, max over ranks; per rank in
mem_gib_per_rank), host_syncs_per_step, call, ...) after every case (``partial``: true until the end, so a call
that runs out of time leaves its rows) and prints the table last. ``--append`` merges into an existing JSON of the
same layout and device; ratios against torchtitan then may cross calls (``titan_other_call``). ``mem_gib`` is the
peak allocated during the timed steps less what earlier cases left allocated (``leftover_gib``: megatron-core's
anchor leaves about 10 GiB behind on TinyLlama, which the following case's peak used to include), with CUDA-graph
pools counted at their reserved size (``graph_pool_gib``; the allocator's peak alone misses a replayed graph's
activations: JSON written before 2026-11-26 undercounts the captured modes that way). ``loss_auto`` lists what
``loss.impl=auto`` decided in the run, per shape, gathered from every rank (the last pipeline stage holds the loss);
JSON written before 2026-11-26 (fourth session) lacks it. ``mem_gib + leftover_gib`` is what the process held at
the case's peak; where ``leftover_gib`` is large, time memory-critical cases first or in a call of their own.

A case that fails on some ranks only (an out-of-memory in one pipeline stage) is an error row on every rank when all
got out of it (``comm.agree``); when a rank stays inside it, blocked in a collective, the call stops after
``AGREE_S`` with its rows so far instead of waiting out the device time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_trainer as bt  # noqa: E402
import titan_anchor  # noqa: E402  (imports torchtitan only when a torchtitan case runs)

from megasparse.config import ConfigError, load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.loss import AUTO_CHOICES  # noqa: E402
from megasparse.metrics import peak_tflops  # noqa: E402
from megasparse.parallel import comm, state  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    # name: (config, GPUs, overrides)
    "1gpu_tinyllama": ("configs/gpu_1b_1gpu.yaml", 1, ["data.prefix=synthetic", "train.global_batch_size=8"]),
    "1gpu_8b4l": ("configs/gpu_8b4l_1gpu.yaml", 1, []),
    "2gpu_8b_tp2sp": ("configs/gpu_8b8l_tp2_sp.yaml", 2, []),
    "2gpu_8b_pp2": ("configs/gpu_8b8l_pp2.yaml", 2, []),
    "2gpu_tinyllama_pp2": ("configs/gpu_1b_pp2.yaml", 2, ["data.prefix=synthetic", "train.global_batch_size=8"]),
    "4gpu_8b_tp2pp2sp": ("configs/gpu_8b8l_tp2_pp2_sp.yaml", 4, []),
    "4gpu_tinyllama_tp2pp2sp": (
        "configs/gpu_1b_tp2_pp2.yaml",
        4,
        ["data.prefix=synthetic", "train.global_batch_size=8"],
    ),
    # issue 16's data-parallel layouts (dp = 2 next to the dp = 1 layouts above) and the interleaved pipeline
    # the distributed optimizer's own path (fused AdamW, 2:4 pieces, owned-range decay) where no 4-GPU machine is lent
    "2gpu_8b_dp2": ("configs/gpu_8b8l_pp2.yaml", 2, ["parallel.pp=1", "parallel.distributed_optimizer=true"]),
    "4gpu_8b_tp2sp_dp2": ("configs/gpu_8b8l_tp2_sp.yaml", 4, ["parallel.distributed_optimizer=true"]),
    "4gpu_8b_pp2_dp2": ("configs/gpu_8b8l_pp2.yaml", 4, ["parallel.distributed_optimizer=true"]),
    "4gpu_8b_pp4v2": ("configs/gpu_8b8l_pp2.yaml", 4, ["parallel.pp=4", "parallel.virtual_stages=2"]),
    # issue 33: the whole Llama-3-8B (32 layers, seq 4096, global batch 32); the default layout and three others
    "4gpu_8b32l": ("configs/gpu_8b_tp2_pp2_sp.yaml", 4, []),
    "4gpu_8b32l_tp2sp_dp2": (
        "configs/gpu_8b_tp2_pp2_sp.yaml",
        4,
        ["parallel.pp=1", "parallel.distributed_optimizer=true"],
    ),
    "4gpu_8b32l_pp2_dp2": (
        "configs/gpu_8b_tp2_pp2_sp.yaml",
        4,
        ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.distributed_optimizer=true"],
    ),
    # micro-batch 2 at PP 2 halves the micro-batches per step and doubles the bubble: the interleaved schedule takes
    # it back, selective recompute and a lighter first rank (it holds more micro-batches in flight) fit the memory
    "4gpu_8b32l_pp2v2_dp2": (
        "configs/gpu_8b_tp2_pp2_sp.yaml",
        4,
        [
            "parallel.tp=1",
            "parallel.sequence_parallel=false",
            "parallel.distributed_optimizer=true",
            "parallel.virtual_stages=2",
            "parallel.layer_split=[7,9,7,9]",
            "model.recompute=selective",
        ],
    ),  # fmt: skip
    "4gpu_8b32l_dp4": (
        "configs/gpu_8b_tp2_pp2_sp.yaml",
        4,
        ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false", "parallel.distributed_optimizer=true"],
    ),
    "4gpu_tinyllama_tp2pp2": (
        "configs/gpu_1b_tp2_pp2.yaml",
        4,
        ["data.prefix=synthetic", "train.global_batch_size=8", "parallel.sequence_parallel=false"],
    ),
}
AGREE_S = 120.0
"""How long ranks that got out of a case wait for the others before the call stops (a rank left blocked in a
collective by another's out-of-memory never arrives; the call used to wait for the whole device time)."""
_COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]
_CCE = ["loss.impl=cce"]
_SPARSE = ["sparsity.enabled=true"]
_FP8 = ["train.fp8=tensorwise"]  # issue 33's fp8 GEMMs: a mode whose key this checkout lacks is reported, not fatal
MODES: dict[str, list[str]] = {
    "dense": [],
    "cce": _CCE,
    "collider": _COLLIDER,
    "2:4": _SPARSE,
    "collider+cce": _COLLIDER + _CCE,
    "collider+2:4": _COLLIDER + _SPARSE,
    "all three": _COLLIDER + _CCE + _SPARSE,
    "fp8": _FP8,
    "collider+fp8": _COLLIDER + _FP8,
    "all four": _COLLIDER + _CCE + _SPARSE + _FP8,
}
EXTRA_MODES: dict[str, list[str]] = {  # not in the default matrix: the dense step with each loss pinned, and eager
    "loss=materialized": ["loss.impl=materialized"],
    "loss=mcore": ["loss.impl=mcore"],
    "cce/scratch224": _CCE + ["loss.cce_scratch_mb=224"],  # P up to 224 MB, not 56 (decision 0206)
    "dense/eager": ["train.cuda_graphs=false"],
    "collider/eager": _COLLIDER + ["train.cuda_graphs=false"],
    "loss_mask": ["filter.mode=loss_mask", "filter.keep_ratio=0.6", "filter.scorer=loss"],
    "dense/recompute-selective": ["model.recompute=selective"],  # activation recompute (decision 0012)
    "dense/recompute-full": ["model.recompute=full"],
    "collider/recompute-full": _COLLIDER + ["model.recompute=full"],
    "collider+cce+fp8": _COLLIDER + _CCE + _FP8,  # all four less 2:4: what turning 2:4 on is held to (decision 1235)
    "fp8/recompute-selective": _FP8 + ["model.recompute=selective"],  # seq 8192 on 80 GB cards (issue 33 item 5)
    "fp8/recompute-full": _FP8 + ["model.recompute=full"],
    "all four/recompute-selective": _COLLIDER + _CCE + _SPARSE + _FP8 + ["model.recompute=selective"],
    "all four/recompute-full": _COLLIDER + _CCE + _SPARSE + _FP8 + ["model.recompute=full"],
}
ALL_MODES = {**MODES, **EXTRA_MODES}
ANCHOR = "mcore-sdpa"
# torchtitan (bf16, float8) and megatron-core, each optional (--anchors); torchtitan first: megatron-core's anchor
# leaves memory behind (bench_trainer: ~10 GiB on TinyLlama) that torchtitan's unsharded-activation step would lack
ANCHORS = (*titan_anchor.CASES, ANCHOR)
TITAN_LAYOUTS = ("1gpu_8b4l", "4gpu_8b32l")  # where --anchors defaults to all three


def count_host_syncs(step) -> int:
    """Synchronisations the CUDA sync debug mode reports during one ``step()``."""
    if not torch.cuda.is_available():
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_mode(cfg, impl: str, warmup: int, steps: int) -> dict:
    """bench_trainer's timed case plus one step with its host synchronisations counted."""
    r = bt.run_case(cfg, impl, warmup, steps, profile=False, after=count_host_syncs)
    r["host_syncs"] = r["after"]
    return r


def mode_overrides(mode: str) -> list[str]:
    """A mode's config overrides (the default matrix's or a pinned loss's)."""
    return ALL_MODES[mode]


def open_layout(tool: str, layout: str, overrides: list[str], modes: list[str], bad_modes: dict | None = None):
    """The layout's base config and every mode's, validated before any process group exists, then the groups:
    (config path, base overrides, base config, world, device, device string); None after a one-line error.

    With ``bad_modes`` (a dict) a mode whose config does not validate is recorded there (mode -> error) and left
    out instead of ending the run: ``fp8`` on a checkout without ``train.fp8``, say."""
    cfg_path, gpus, layout_ov = LAYOUTS[layout]
    world = state.world_env()[1]
    if world != gpus:
        print(f"{tool}: layout {layout} needs {gpus} ranks (torchrun --nproc_per_node {gpus}), got {world}")
        return None
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        print(f"{tool}: unknown modes {bad}; use {list(ALL_MODES)}", file=sys.stderr)
        return None
    base_ov = layout_ov + list(overrides)
    try:
        base = load_config(str(ROOT / cfg_path), base_ov)
        base.validate(world)
    except ConfigError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        return None
    for m in modes:
        try:
            load_config(str(ROOT / cfg_path), base_ov + mode_overrides(m)).validate(world)
        except ConfigError as e:
            if bad_modes is None:
                print(f"{tool}: error: {e}", file=sys.stderr)
                return None
            bad_modes[m] = f"ConfigError: {e}"
            if state.world_env()[0] == 0:
                print(f"{tool}: mode {m!r} skipped: {e}", file=sys.stderr)
    p = base.parallel
    state.init(p.tp, p.pp, p.sequence_parallel, p.backend)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = f"{world}x {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"{world}x cpu"
    return cfg_path, base_ov, base, world, dev, device


def parse_anchors(a: argparse.Namespace) -> list[str] | None:
    """``--anchors`` (default: all three on ``TITAN_LAYOUTS``, megatron-core elsewhere); None after an error."""
    text = a.anchors if a.anchors is not None else ",".join(ANCHORS if a.layout in TITAN_LAYOUTS else (ANCHOR,))
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in ANCHORS]
    if bad:
        print(f"bench_e2e: unknown anchors {bad}; use {list(ANCHORS)} (or --anchors '' for none)", file=sys.stderr)
        return None
    return names


def time_case(name: str, cfg, a: argparse.Namespace) -> dict:
    """One case's timed run: a torchtitan anchor, megatron-core's, or megasparse in a mode."""
    if name in titan_anchor.CASES:
        fp8_ag = a.titan_fp8_allgather == "on"
        return titan_anchor.run_case(cfg, name, a.warmup, a.steps, count_host_syncs, a.titan_ac, fp8_ag)
    return run_mode(cfg, ANCHOR if name == ANCHOR else "megasparse", bt.warmup_steps(cfg, a.warmup), a.steps)


def run(a: argparse.Namespace) -> int:
    modes = [m for m in a.modes.split(",") if m]
    anchors = parse_anchors(a)
    bad_modes: dict[str, str] = {}
    opened = None if anchors is None else open_layout("bench_e2e", a.layout, a.overrides, modes, bad_modes)
    if opened is None:
        return 2
    cfg_path, base_ov, base, world, dev, device = opened
    p = base.parallel
    vocab_padded = base.padded_vocab(bt.build_data(base)[2])
    m = base.model
    call = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # which rows shared a call, once JSONs are merged
    report: dict = {
        "device": device,
        "layout": a.layout,
        "config": cfg_path,
        "overrides": base_ov,
        "shape": f"{m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/"
        f"{m.num_query_groups or m.num_attention_heads}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, "
        f"seq {m.seq_length}, tp {p.tp} pp {p.pp}{' +SP' if p.sequence_parallel else ''}"
        f"{f' dp {world // (p.tp * p.pp)}' if world > p.tp * p.pp else ''}"
        f"{' +distopt' if p.distributed_optimizer else ''}, global batch {base.train.global_batch_size}",
        "torch": torch.__version__,
        "call": call,
        "cases": [],
    }
    out = Path(a.out_dir) / f"e2e_{a.layout}.json"
    old = json.loads(out.read_text()) if a.append and out.exists() else None  # read before this call writes it
    ok = not bad_modes
    warm_gpu(a.gpu_warmup_s, dev)
    report["drift"] = {}
    for mb in [int(x) for x in a.micro.split(",")]:
        mb_ov = [f"train.micro_batch_size={mb}"]
        repeat = a.repeat and "dense" in modes and len(modes) > 1
        names = anchors + modes + ([x for x in (ANCHOR, "dense") if x in anchors + modes] if repeat else [])
        seen: set[str] = set()
        mb_cases: list[dict] = []
        errors: list[dict] = []  # after the micro-batch's timed rows
        for name in names:
            again = name in seen
            seen.add(name)
            if name in bad_modes:
                if not again:
                    errors.append({"mode": name, "micro_batch_size": mb, "error": bad_modes[name]})
                continue
            cfg = load_config(str(ROOT / cfg_path), base_ov + mb_ov + ([] if name in ANCHORS else mode_overrides(name)))
            bt.log0(f"--- {name}{' (again)' if again else ''} micro_batch_size={mb} ---")
            if name in ANCHORS and dev.type != "cuda":  # a CPU run (smoke test of a layout): megasparse rows only
                if not again:
                    errors.append({"mode": name, "micro_batch_size": mb, "error": "needs CUDA (skipped)"})
                continue
            failure = None
            try:
                r = time_case(name, cfg, a)
            except Exception as e:  # an OOM is itself a result; keep going when every rank got out of the case
                traceback.print_exc()
                failure = f"{type(e).__name__}: {e}"
            # agreed before freeing: empty_cache can wait on a block whose NCCL work waits for a rank still inside
            agreed = comm.agree(failure is None, AGREE_S)
            if not agreed:
                row = {"mode": name, "micro_batch_size": mb, "error": failure or "failed on another rank"}
                if agreed is None:  # a rank is still in the case, blocked in a collective this one left: stop
                    rank = dist.get_rank()
                    if rank:  # rank 0 may be the blocked one: this rank's rows, beside its file
                        out = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
                    write_report(out, report, old, mb_cases + errors + [row], partial=True, rank0_only=False)
                    here = f"failed on rank {rank} ({failure})" if failure else f"done on rank {rank}"
                    print(
                        f"bench_e2e: {name} {here} and a rank is still inside it after {AGREE_S:.0f} s; stopping the "
                        f"call (rows so far: {out})",
                        flush=True,
                    )
                    os._exit(1)  # torchrun stops the blocked ranks
                bt._free()
                if not again:
                    errors.append(row)
                ok = False
                continue
            case = case_row(cfg, name, r, vocab_padded, world, dev)
            case["call"], case["again"] = call, again
            ok &= all(math.isfinite(x) for x in r["losses"])
            mb_cases.append(case)
            bt.log0(f"{name} mb={mb}: {case['step_ms']:.1f} ms, syncs {case['host_syncs_per_step']:.0f}")
            write_report(out, report, old, mb_cases + errors, partial=True)  # a timed-out call leaves its rows
        report["drift"][str(mb)] = settle_ratios(mb_cases)
        report["cases"] += [c for c in mb_cases if not c.pop("again")] + errors
    report["loss_auto"] = auto_choices()
    write_report(out, report, old, [], partial=False)
    state.destroy()
    return 0 if ok else 1


def case_row(cfg, name: str, r: dict, vocab_padded: int, world: int, dev: torch.device) -> dict:
    """A timed case's JSON row: the slowest rank's median step, throughput, both MFUs, memory, syncs."""
    times = bt.gather_floats(r["times"], dev)
    mems = [x[0] for x in bt.gather_floats([r["mem_gib"]], dev)]
    syncs = [x[0] for x in bt.gather_floats([float(r["after"] or 0)], dev)]
    row = bt.summarize(cfg, name, vocab_padded, times, mems, world)
    peak = peak_tflops(dev)
    case = {
        "mode": name,
        "micro_batch_size": cfg.train.micro_batch_size,
        "step_ms": row["step_ms"],
        "mfu": row["mfu"],
        "mfu_titan_formula": row["tokens_per_s_per_gpu"] * titan_anchor.titan_flops_per_token(cfg.model) / 1e12 / peak
        if peak
        else None,
        "tflops_per_gpu": row["tflops_per_gpu"],
        "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
        "mem_gib": row["mem_gib_max_rank"],
        "mem_gib_per_rank": row["mem_gib_per_rank"],
        "leftover_gib": max(x[0] for x in bt.gather_floats([r["leftover_gib"]], dev)),
        "graph_pool_gib": max(x[0] for x in bt.gather_floats([r["graph_pool_gib"]], dev)),
        "optim_state_gib": max(x[0] for x in bt.gather_floats([r["optim_state_gib"]], dev)),
        "host_syncs_per_step": max(syncs),
        "step_ms_per_rank": row["step_ms_per_rank"],
        "step_ms_spread": row["step_ms_spread"],
        "losses": r["losses"],
    }
    case.update({k: v for k, v in r.items() if k.startswith(("titan_", "warmup_"))})  # torchtitan's own facts
    return case


def merge_reports(old: dict, new: dict) -> dict:
    """``new`` with ``old``'s rows of other (mode, micro-batch) pairs kept (same device: the caller checks)."""
    rep = dict(new)
    mine = {(c["mode"], c["micro_batch_size"]) for c in new["cases"]}
    kept = [c for c in old["cases"] if (c["mode"], c["micro_batch_size"]) not in mine]
    rep["cases"] = sorted(kept + new["cases"], key=lambda c: c["micro_batch_size"])
    rep["drift"] = {**old.get("drift", {}), **new.get("drift", {})}
    rep["loss_auto"] = list(dict.fromkeys(old.get("loss_auto", []) + new.get("loss_auto", [])))
    rep["calls"] = list(dict.fromkeys(old.get("calls", [old.get("call")]) + [new.get("call")]))
    return rep


def write_report(
    out: Path, report: dict, old: dict | None, pending: list[dict], partial: bool, rank0_only: bool = True
) -> None:
    """Rank 0 (or, ``rank0_only`` false, the caller) writes the JSON: this call's rows (plus ``pending``, the
    current micro-batch's so far), merged into ``old`` (``--append``: same device, rows of this call replace equal
    (mode, micro-batch) rows), with the ratios against torchtitan and the table. Written after every case
    (``partial``) and at the end."""
    now = [{k: v for k, v in c.items() if k != "again"} for c in pending if not c.get("again")]
    rep = {**report, "cases": report["cases"] + now, "partial": partial}
    if old is not None and old.get("device") == rep["device"]:
        rep = merge_reports(old, rep)
    titan_ratios(rep["cases"])
    rep["table"] = format_table(rep)
    if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=1))
        if not partial:
            print(rep["table"], flush=True)


def merge_files(paths: list[str], out_dir: str) -> int:
    """``--merge``: JSONs of one layout and device from several calls (later files' rows win) into one, with the
    ratios against torchtitan recomputed across them (``titan_other_call`` flags those)."""
    reps = [json.loads(Path(x).read_text()) for x in paths]
    keys = {(r["layout"], r["device"]) for r in reps}
    if len(keys) != 1:
        print(f"bench_e2e: --merge needs one layout on one device, got {sorted(keys)}", file=sys.stderr)
        return 2
    merged = reps[0]
    for r in reps[1:]:
        merged = merge_reports(merged, r)
    out = Path(out_dir) / f"e2e_{merged['layout']}.json"
    write_report(out, {**merged, "cases": merged["cases"]}, None, [], partial=False)
    print(out)
    return 0


def titan_ratios(cases: list[dict]) -> None:
    """Each row's step time over torchtitan's (bf16 and float8) at the same micro-batch, where that ran; rows of
    another call (``call`` differs, after ``--append``) are compared too and flagged ``titan_other_call``."""
    for c in cases:
        for name, key in (("torchtitan-bf16", "ratio_vs_titan_bf16"), ("torchtitan-fp8", "ratio_vs_titan_fp8")):
            t = next((x for x in cases if x["mode"] == name and x["micro_batch_size"] == c["micro_batch_size"]), None)
            ok = t is not None and "error" not in t and "error" not in c
            c.pop(key, None)
            if ok:
                c[key] = c["step_ms"] / t["step_ms"]
                if t.get("call") != c.get("call"):
                    c["titan_other_call"] = True


def auto_choices() -> list[str]:
    """``loss.impl=auto``'s decisions on any rank of this run, in first-seen order (rank 0 may hold no loss)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(AUTO_CHOICES))
    return list(dict.fromkeys(r for rank in every for r in rank))


def warm_gpu(seconds: float, dev: torch.device) -> None:
    """Run bf16 GEMMs until the GPU's clock settles: on a cool GPU the first cases run up to 4% faster than the
    same case minutes later (H100, 2026-11-25: a fixed 8192³ GEMM went from 1.50 to 1.59 ms over one call)."""
    if seconds <= 0 or dev.type != "cuda":
        return
    import time

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(dev)
    del a
    bt._free()


def settle_ratios(mb_cases: list[dict]) -> dict:
    """Ratios of one micro-batch's cases against the mean of the first and the repeated anchor and dense runs (a
    linear clock drift over the cases then cancels to first order); the drift itself is returned for the JSON."""

    def mean_of(mode: str) -> tuple[float | None, list[float]]:
        xs = [c["step_ms"] for c in mb_cases if c["mode"] == mode]
        return (sum(xs) / len(xs) if xs else None), xs

    anchor_ms, anchor_runs = mean_of(ANCHOR)
    dense_ms, dense_runs = mean_of("dense")
    for c in mb_cases:
        c["anchor_step_ms"] = anchor_ms
        c["ratio_vs_anchor"] = c["step_ms"] / anchor_ms if anchor_ms else None
        c["ratio_vs_dense"] = c["step_ms"] / dense_ms if dense_ms and c["mode"] not in ANCHORS else None
    drift = {"anchor_runs_ms": anchor_runs, "dense_runs_ms": dense_runs}
    for name, runs in (("anchor", anchor_runs), ("dense", dense_runs)):
        if len(runs) > 1:
            drift[f"{name}_drift"] = runs[-1] / runs[0] - 1
    if len(anchor_runs) > 1 or len(dense_runs) > 1:
        bt.log0("drift over the cases: " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in drift.items() if "drift" in k))
    return drift


def _held(case: dict) -> bool:
    """Whether a row's peak memory left out what earlier cases held (``leftover_gib``), past the note's threshold."""
    return (case.get("leftover_gib") or 0.0) > bt.LEFTOVER_NOTE_GIB


def format_table(report: dict) -> str:
    head = (
        f"{'mode':<16} {'mb':>3} {'step ms':>9} {'vs mcore':>9} {'vs dense':>9} {'vs tt-bf16':>10} {'vs tt-fp8':>9} "
        f"{'MFU':>6} {'tok/s/GPU':>9} {'mem GiB':>8} {'optim GiB':>9} {'syncs':>6}"
    )
    lines = [f"e2e | {report['device']} | {report['layout']}: {report['shape']}", head, "-" * len(head)]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"{c['mode']:<16} {c['micro_batch_size']:>3} {c['error'][:100]}")
            continue

        def f(key, spec, c=c):
            return bt.cell(c, key, spec)

        mfu = f"{100 * c['mfu']:5.1f}%" if c.get("mfu") is not None else f"{'-':>6}"
        lines.append(
            f"{c['mode']:<16} {c['micro_batch_size']:>3} {c['step_ms']:9.1f} {f('ratio_vs_anchor', '9.3f')} "
            f"{f('ratio_vs_dense', '9.3f')} {f('ratio_vs_titan_bf16', '10.3f')} {f('ratio_vs_titan_fp8', '9.3f')} "
            f"{mfu} {f('tokens_per_s_per_gpu', '9.0f')} {c['mem_gib']:8.2f}{'*' if _held(c) else ' '}"
            f"{f('optim_state_gib', '9.2f')} {c['host_syncs_per_step']:6.0f}"
        )
    held = [c for c in report["cases"] if "error" not in c and _held(c)]
    if held:
        lines.append(
            f"mem GiB*: the case started with {max(c['leftover_gib'] for c in held):.1f} GiB an earlier case left "
            "allocated, not counted; a run of its own may need up to that much more (a whole-8B dense case's 7.5 GiB "
            "was: reports/2026-11-27-4gpu-split-seq8192.md)"
        )
    lines.append(
        f"vs mcore, vs tt-bf16, vs tt-fp8: step time / megatron-core's ({ANCHOR}), torchtitan's bf16, its float8 step "
        "at the same micro-batch (< 1: faster); MFU: the dense model's FLOPs per token at this rate, so modes that "
        "skip work (filtering, 2:4) can read above 100%"
    )
    lines += report.get("loss_auto", [])
    return "\n".join(lines)


def plot(json_path: str, out_png: str | None = None) -> str:
    """Bars of step time relative to megatron-core, per mode, one group per micro-batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = json.loads(Path(json_path).read_text())
    cases = [c for c in rep["cases"] if "error" not in c and c["mode"] != ANCHOR]
    mbs = sorted({c["micro_batch_size"] for c in cases})
    modes = [m for m in ALL_MODES if any(c["mode"] == m for c in cases)]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(modes) * len(mbs) / 2, 3.6))
    width = 0.8 / max(1, len(mbs))
    for i, mb in enumerate(mbs):
        at = {c["mode"]: c["ratio_vs_anchor"] or 0 for c in cases if c["micro_batch_size"] == mb}
        ys = [at.get(m, 0) for m in modes]
        ax.bar([x + i * width for x in range(len(modes))], ys, width, label=f"micro-batch {mb}")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([x + width * (len(mbs) - 1) / 2 for x in range(len(modes))], modes, rotation=20)
    ax.set_ylabel("step time / megatron-core dense")
    ax.set_title(f"{rep['layout']} — {rep['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = out_png or str(ROOT / "docs" / "img" / f"e2e_{rep['layout']}.png")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def plot_throughput(json_paths: list[str], out_png: str) -> str:
    """Tokens/s/GPU per run, one bar series per JSON (its layout and micro-batch): the torchtitan anchors next to
    megasparse's modes, for the whole-8B comparison where each call's anchors ran beside its rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for path in json_paths:
        rep = json.loads(Path(path).read_text())
        for mb in sorted({c["micro_batch_size"] for c in rep["cases"] if "error" not in c}):
            rows = {c["mode"]: c["tokens_per_s_per_gpu"] for c in rep["cases"]
                    if "error" not in c and c["micro_batch_size"] == mb}  # fmt: skip
            series.append((f"mb {mb}: {rep['layout']} (anchors: their own layout)", rows, rep["device"]))
    anchors = [m for m in (*titan_anchor.CASES, ANCHOR) if any(m in rows for _, rows, _ in series)]
    modes = {m for _, rows, _ in series for m in rows if m not in anchors}
    best = {m: max(rows.get(m, 0) for _, rows, _ in series) for m in modes}
    runs = anchors + sorted(modes, key=best.get)  # megasparse's modes slowest to fastest
    fig, ax = plt.subplots(figsize=(1.5 + 1.0 * len(runs), 3.8))
    width = 0.8 / max(1, len(series))
    for i, (label, rows, _) in enumerate(series):
        xs = [x + i * width for x, m in enumerate(runs) if m in rows]
        ax.bar(xs, [rows[m] for m in runs if m in rows], width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(runs))], runs, rotation=20, fontsize=8)
    ax.set_ylabel("tokens/s per GPU (higher is faster)")
    ax.set_title(" / ".join(sorted({d for _, _, d in series})), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return out_png


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", nargs="?", choices=list(LAYOUTS))
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for every case")
    p.add_argument("--micro", default="1,2")
    p.add_argument("--modes", default=",".join(MODES))
    anchors_help = f"subset of {ANCHORS} (default: all on {TITAN_LAYOUTS}, {ANCHOR} elsewhere; '' for none)"
    p.add_argument("--anchors", default=None, help=anchors_help)
    p.add_argument("--titan-ac", default="none", choices=titan_anchor.AC_MODES, help="torchtitan's recompute")
    p.add_argument("--titan-fp8-allgather", default="on", choices=("on", "off"), help="torchtitan-fp8's FSDP gathers")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "docs" / "benchmarks" / "data")))
    p.add_argument("--append", action="store_true", help="merge into an existing JSON of this layout and device")
    p.add_argument("--gpu-warmup-s", type=float, default=45.0, help="GEMMs before the first case, to settle clocks")
    p.add_argument("--no-repeat", dest="repeat", action="store_false", help="skip re-timing anchor and dense last")
    p.add_argument("--plot", default=None, help="only plot this JSON to docs/img/e2e_<layout>.png")
    p.add_argument("--plot-throughput", nargs="+", default=None, metavar="JSON", help="only plot tokens/s/GPU of "
                   "these JSONs' runs, anchors included, to --png")  # fmt: skip
    p.add_argument("--png", default=str(ROOT / "docs" / "img" / "e2e_throughput.png"), help="--plot-throughput's file")
    p.add_argument("--merge", nargs="+", default=None, help="only merge these JSONs (one layout, several calls)")
    return parse_with_overrides(p, argv)  # key=value anywhere on the line


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.plot:
        print(plot(a.plot))
        return 0
    if a.plot_throughput:
        print(plot_throughput(a.plot_throughput, a.png))
        return 0
    if a.merge:
        return merge_files(a.merge, a.out_dir)
    if a.layout is None:
        print(f"bench_e2e: name a layout: {list(LAYOUTS)}", file=sys.stderr)
        return 2
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
