"""Two megasparse modes timed step by step in alternation, for differences smaller than a call's clock drift.

    torchrun --nproc_per_node N benchmarks/bench_pair.py LAYOUT --pairs dense:2:4,collider:collider+2:4
        [--micro 1] [--rounds 8] [--out-dir docs/benchmarks/data] [section.key=value ...]

Why: ``bench_e2e.py`` times each mode in its own block of steps, minutes apart; the GPU's clock drifts 3–13% over
such a call (``docs/benchmarks.md`` §0), so a 1% question ("is 2:4 slower than dense at micro-batch 1?") drowns.
Here both trainers of a pair live in one process (same layout, ``LAYOUTS`` and ``ALL_MODES`` of ``bench_e2e``) and
each round times one step of each, in ABBA order, so a drift that is linear over a round cancels. The answer is
the median of the per-round ratios B/A with its spread (min, max); the step times are medians too.

Writes ``pair_<layout>.json`` (``device``, ``layout``, ``pairs``: a, b, micro_batch_size, a_ms, b_ms,
ratio_b_over_a, ratio_min, ratio_max, rounds) and prints the table last. Memory: both trainers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as be  # noqa: E402
import bench_trainer as bt  # noqa: E402

from megasparse.config import load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.parallel import state  # noqa: E402
from megasparse.train import Trainer  # noqa: E402


def _step(tr: Trainer) -> float:
    bt._sync(tr.device)
    return tr.train_step().seconds


def time_pair(cfg_a, cfg_b, warmup: int, rounds: int) -> dict:
    """Build both trainers, warm each up, then ``rounds`` ABBA rounds; per-round B/A ratios of the slowest rank."""
    tr_a, tr_b = Trainer(cfg_a, init_groups=False), Trainer(cfg_b, init_groups=False)
    for tr, cfg in ((tr_a, cfg_a), (tr_b, cfg_b)):
        for _ in range(bt.warmup_steps(cfg, warmup)):
            _step(tr)
    ta, tb = [], []
    for _ in range(rounds):
        a1, b1 = _step(tr_a), _step(tr_b)
        b2, a2 = _step(tr_b), _step(tr_a)
        ta.append((a1 + a2) / 2)
        tb.append((b1 + b2) / 2)
    dev = tr_a.device
    ta = [max(x) for x in zip(*bt.gather_floats(ta, dev))]  # slowest rank per round
    tb = [max(x) for x in zip(*bt.gather_floats(tb, dev))]
    for tr in (tr_a, tr_b):
        if getattr(tr, "graphs", None) is not None:
            tr.graphs.release()
    del tr_a, tr_b
    bt._free()
    ratios = [b / a for a, b in zip(ta, tb)]
    return {
        "a_ms": 1e3 * statistics.median(ta),
        "b_ms": 1e3 * statistics.median(tb),
        "ratio_b_over_a": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
    }


def format_table(report: dict) -> str:
    head = f"{'A':<14} {'B':<14} {'mb':>3} {'A ms':>8} {'B ms':>8} {'B/A':>7} {'min':>7} {'max':>7}"
    lines = [f"pair | {report['device']} | {report['layout']}: {report['shape']}", head, "-" * len(head)]
    for p in report["pairs"]:
        lines.append(
            f"{p['a']:<14} {p['b']:<14} {p['micro_batch_size']:>3} {p['a_ms']:8.1f} {p['b_ms']:8.1f} "
            f"{p['ratio_b_over_a']:7.3f} {p['ratio_min']:7.3f} {p['ratio_max']:7.3f}"
        )
    lines.append("B/A: median over ABBA rounds of B's step time / A's (< 1: B faster); min/max: the rounds' spread")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=list(be.LAYOUTS))
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for every trainer")
    p.add_argument("--pairs", default="dense:2:4,collider:collider+2:4", help="A:B,... (modes of bench_e2e.ALL_MODES)")
    p.add_argument("--micro", default="1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(be.ROOT / "docs" / "benchmarks" / "data")))
    return parse_with_overrides(p, argv)  # key=value anywhere on the line


def _split_pair(text: str) -> tuple[str, str]:
    """'dense:2:4' -> ('dense', '2:4'): the first ':' that leaves two known modes."""
    for i, ch in enumerate(text):
        if ch == ":" and text[:i] in be.ALL_MODES and text[i + 1 :] in be.ALL_MODES:
            return text[:i], text[i + 1 :]
    raise ValueError(f"--pairs entry {text!r}: use A:B with A and B among {list(be.ALL_MODES)}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        pairs = [_split_pair(x) for x in a.pairs.split(",") if x]
    except ValueError as e:
        print(f"bench_pair: error: {e}", file=sys.stderr)
        return 2
    opened = be.open_layout("bench_pair", a.layout, a.overrides, sorted({m for pair in pairs for m in pair}))
    if opened is None:
        return 2
    cfg_path, base_ov, base, world, dev, device = opened
    p = base.parallel
    m = base.model
    report: dict = {
        "device": device,
        "layout": a.layout,
        "shape": f"{m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, seq {m.seq_length}, "
        f"tp {p.tp} pp {p.pp}, global batch {base.train.global_batch_size}",
        "overrides": base_ov,
        "torch": torch.__version__,
        "pairs": [],
    }
    be.warm_gpu(20.0, dev)
    for mb in [int(x) for x in a.micro.split(",")]:
        for pa, pb in pairs:
            cfgs = [
                load_config(str(be.ROOT / cfg_path), base_ov + [f"train.micro_batch_size={mb}"] + be.mode_overrides(x))
                for x in (pa, pb)
            ]
            bt.log0(f"--- {pa} vs {pb}, micro_batch_size={mb} ---")
            r = time_pair(cfgs[0], cfgs[1], a.warmup, a.rounds)
            report["pairs"].append({"a": pa, "b": pb, "micro_batch_size": mb, **r})
            bt.log0(f"{pb} / {pa} at mb {mb}: {r['ratio_b_over_a']:.4f} ({r['ratio_min']:.4f}..{r['ratio_max']:.4f})")
    report["table"] = format_table(report)
    if state.world_env()[0] == 0:
        out = Path(a.out_dir) / f"pair_{a.layout}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(report["table"], flush=True)
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
