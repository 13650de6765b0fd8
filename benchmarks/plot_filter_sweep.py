"""Plot step-time speedup (dense / collider) against keep ratio, one line per sequence length, from the JSON
that ``bench_filter.py --sweep`` writes.

    python benchmarks/plot_filter_sweep.py docs/benchmarks/data/bench_filter_h200_mb2_sweep.json \
        docs/img/filter_sweep.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> int:
    src, out = argv
    d = json.load(open(src))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for seq in sorted({r["seq"] for r in d["sweep"]}):
        pts = sorted((r["keep"], r["step_speedup"], r["bwd_ratio"]) for r in d["sweep"] if r["seq"] == seq)
        keeps = [p[0] for p in pts]
        axes[0].plot(keeps, [p[1] for p in pts], marker="o", label=f"seq {seq}")
        axes[1].plot(keeps, [p[2] for p in pts], marker="o", label=f"seq {seq}")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xlabel="keep ratio", ylabel="step speedup (dense / collider)", title="step time")
    axes[1].plot([0.3, 0.9], [0.3, 0.9], color="grey", ls="--", lw=0.8, label="ideal (= keep)")
    axes[1].set(xlabel="keep ratio", ylabel="backward time collider / dense", title="backward time")
    for ax in axes:
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    fig.suptitle(f"Collider vs dense, {d['device']}, {d['layers']} TinyLlama layers, torch {d['torch']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
