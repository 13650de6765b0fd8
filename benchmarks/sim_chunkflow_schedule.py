"""ChunkFlow's pipeline schedules in simulated slots: idle stage-slots of the state-aware 1F1B against the
GPipe-per-group order on long-tail steps (decision 1226's table). Pure Python, CPU, a few seconds.

    python benchmarks/sim_chunkflow_schedule.py [--steps 20] [--sequences 64] [--max-length 32768]
        [--chunk-sizes 4096,8192] [--pp 2,4] [--keeps 1,4] [--pack | --no-pack] [--weighted-tables]

Lengths come from ``megasparse data longtail``'s distribution (``data/longtail.py``: about 90% of sequences at
or below 4K tokens, a tail to 32K), ``--sequences`` per step, planned by ``chunkflow/plan.py`` for one DP rank
(``--pack``: short sequences share chunks, as under document attention). A slot is one chunk forward or backward
on one stage, each op one slot as the trainer builds them (``--weighted-tables``: forward, backward and rerun of
1, 2, 1 slots). "idle slots" counts the table (sends buffered); "idle time" runs it with a backward twice a
forward and a K-bound rerun one more (``schedule.COST``), with each stage on its own clock meeting its
neighbours at rendezvous transfers, as the executor does. Transfers take no time. Both compare orders, not GPU
time. Idle sums over the steps; ``peak`` is the most chunks holding activations on a stage.
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np

from megasparse.chunkflow.plan import plan_step
from megasparse.chunkflow.schedule import COST, UNIT, gpipe_per_group, simulate, state_aware
from megasparse.data.longtail import LongTailSpec, longtail_lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--max-length", type=int, default=32768)
    p.add_argument("--chunk-sizes", default="4096,8192")
    p.add_argument("--pp", default="2,4")
    p.add_argument("--keeps", default="1,4")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--weighted-tables", action="store_true", help="build the tables with COST slots, not one per op")
    a = p.parse_args()
    lengths = longtail_lengths(LongTailSpec(docs=a.steps * a.sequences, max_length=a.max_length))
    print(f"{a.steps} steps of {a.sequences} sequences, max {a.max_length} tokens, pack={a.pack}")
    cost = COST if a.weighted_tables else UNIT
    print(f"tables built with (F, B, rerun) = {cost} slots; idle time with {COST}")
    print("| chunk | pp | K | chunks/step | order | slots | idle slots | idle time, B = 2F | peak |")
    print("|---" * 9 + "|")
    orders = {"gpipe": gpipe_per_group, "state-aware": state_aware, "2 in flight": partial(state_aware, window=2)}
    for c in (int(x) for x in a.chunk_sizes.split(",")):
        plans = [plan_step([int(n) for n in part], c, dp=1, pack=a.pack) for part in np.split(lengths, a.steps)]
        sizes = [tuple(len(g.chunks) for g in pl.groups) for pl in plans]
        for pp in (int(x) for x in a.pp.split(",")):
            for k in (int(x) for x in a.keeps.split(",")):
                for name, build in orders.items():
                    reps = [simulate(build(pp, s, k, cost=cost)) for s in sizes]
                    slots, idle = sum(r.length for r in reps), sum(r.idle for r in reps)
                    span, idle_t = sum(r.time for r in reps), sum(r.idle_time for r in reps)
                    row = [c, pp, k, f"{np.mean([sum(s) for s in sizes]):.1f}", name, slots]
                    row += [f"{idle} ({idle / (slots * pp):.1%})", f"{idle_t:.0f} ({idle_t / (span * pp):.1%})"]
                    row += [max(max(r.peak_graphs) for r in reps)]
                    print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
