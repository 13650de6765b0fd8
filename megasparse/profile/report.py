"""Pure functions over recorded transfers: load ``comm.json``, group, compare, render, plot.

Nothing here touches torch.distributed or the trainer, so tests and notebooks can work from synthetic
records or an existing ``comm.json``. A record is a dict with the fields of ``comm.CommRecord`` plus
``rank``. Bytes are each rank's payload (the tensor it hands to the collective, padding included; for
P2P only the sender counts), summed over ranks and counted steps: what matters is the ratio between
runs of the same layout, which this choice does not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

GROUP_KEYS: tuple[str, ...] = ("phase", "kind", "group")
PHASES: tuple[str, ...] = ("forward", "backward", "optim", "metrics")
"""Display order of phases (unknown phases go last)."""
CLASSES: tuple[str, ...] = ("token", "param", "metrics", "other")
CLASS_HELP = {
    "token": "token-sized, total (TP/SP collectives of forward/backward, PP sends)",
    "token.forward": "token-sized, forward",
    "token.backward": "token-sized, backward",
    "param": "parameter-sized: optim phase (DP grad reduction, SP norm grads, grad norm, parameter all-gather)",
    "metrics": "metrics: loss/statistics reductions",
    "other": "other phases",
}
CLASS_ROWS: tuple[str, ...] = ("token.forward", "token.backward", "token", "param", "metrics", "other")
"""Rows of ``class_totals``: the token class also split by phase (Collider shrinks only the backward)."""


@dataclass
class Totals:
    """Sums over a set of records."""

    calls: int = 0
    numel: int = 0
    bytes: int = 0
    ms: float | None = None
    """Summed duration; None unless some record was timed (GPU with time_on_gpu)."""

    def add(self, rec: dict) -> None:
        self.calls += 1
        self.numel += int(rec["numel"])
        self.bytes += int(rec["bytes"])
        d = rec.get("duration_ms")
        if d is not None:
            self.ms = (self.ms or 0.0) + float(d)


def traffic_class(rec: dict) -> str:
    """Token-sized traffic scales with kept tokens under Collider; parameter-sized must not change."""
    phase = rec["phase"]
    if phase in ("forward", "backward"):
        return "token"
    if phase == "optim":
        return "param"
    if phase == "metrics":
        return "metrics"
    return "other"


def counted(records: Iterable[dict], warmup_steps: int = 0) -> list[dict]:
    """Records of the steps that count (``step >= warmup_steps``)."""
    return [r for r in records if int(r.get("step", -1)) >= warmup_steps]


def _phase_rank(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)


def group_records(records: Iterable[dict], keys: Sequence[str] = GROUP_KEYS) -> dict[tuple, Totals]:
    """Totals per distinct value of ``keys`` (default (phase, kind, group)); phases in PHASES order."""
    out: dict[tuple, Totals] = {}
    for r in records:
        out.setdefault(tuple(r[k] for k in keys), Totals()).add(r)
    if "phase" in keys:
        i = list(keys).index("phase")
        out = dict(sorted(out.items(), key=lambda kv: _phase_rank(kv[0][i])))  # stable: first-seen within a phase
    return out


def class_totals(records: Iterable[dict]) -> dict[str, Totals]:
    """Totals per CLASS_ROWS entry (token split into forward/backward, plus its total); all present."""
    out = {c: Totals() for c in CLASS_ROWS}
    for r in records:
        c = traffic_class(r)
        out[c].add(r)
        if c == "token":
            out[f"token.{r['phase']}"].add(r)
    return out


def ratio(num: float, den: float) -> float | None:
    """num/den, None when the anchor moved nothing (1.0 when neither did)."""
    if den == 0:
        return 1.0 if num == 0 else None
    return num / den


def byte_ratios(filtered: dict, dense: dict) -> dict:
    """Per-key filtered/dense byte ratio over the union of keys (a key missing on one side counts 0)."""
    keys = list(dense) + [k for k in filtered if k not in dense]
    zero = Totals()
    return {k: ratio(filtered.get(k, zero).bytes, dense.get(k, zero).bytes) for k in keys}


# ------------------------------------------------------------------------------------------ text
def _mb(b: int) -> str:
    return f"{b / 1e6:.4g}"


def _ratio_text(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.3f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _has_time(groups: dict) -> bool:
    return any(t.ms is not None for t in groups.values())


def group_table(groups: dict[tuple, Totals], keys: Sequence[str] = GROUP_KEYS) -> str:
    """Calls, elements, MB (and ms where timed) per group; a total row last."""
    timed = _has_time(groups)
    headers = [*keys, "calls", "elements", "MB"] + (["ms"] if timed else [])
    total = Totals()
    rows = []
    for k, t in groups.items():
        row = [*k, t.calls, t.numel, _mb(t.bytes)]
        if timed:
            row.append("-" if t.ms is None else f"{t.ms:.3f}")
        rows.append(row)
        total.calls, total.numel, total.bytes = total.calls + t.calls, total.numel + t.numel, total.bytes + t.bytes
        if t.ms is not None:
            total.ms = (total.ms or 0.0) + t.ms
    last = ["**total**"] + [""] * (len(keys) - 1) + [total.calls, total.numel, _mb(total.bytes)]
    if timed:
        last.append("-" if total.ms is None else f"{total.ms:.3f}")
    return markdown_table(headers, rows + [last])


def compare_table(
    filtered: dict[tuple, Totals],
    dense: dict[tuple, Totals],
    label: str = "filtered",
    keys: Sequence[str] = GROUP_KEYS,
) -> str:
    """Dense vs filtered MB per group and their ratio."""
    zero = Totals()
    rows = []
    for k, r in byte_ratios(filtered, dense).items():
        rows.append([*k, _mb(dense.get(k, zero).bytes), _mb(filtered.get(k, zero).bytes), _ratio_text(r)])
    return markdown_table([*keys, "dense MB", f"{label} MB", f"{label}/dense"], rows)


def class_table(primary: dict[str, Totals], dense: dict[str, Totals] | None = None, label: str = "run") -> str:
    """Traffic-class totals, with the ratio to the dense run when there is one."""
    headers = ["class", "calls", f"{label} MB"] + (["dense MB", f"{label}/dense"] if dense else [])
    rows = []
    for c in CLASS_ROWS:
        t = primary[c]
        if t.calls == 0 and (dense is None or dense[c].calls == 0):
            continue
        row = [CLASS_HELP[c], t.calls, _mb(t.bytes)]
        if dense:
            row += [_mb(dense[c].bytes), _ratio_text(ratio(t.bytes, dense[c].bytes))]
        rows.append(row)
    return markdown_table(headers, rows)


# ------------------------------------------------------------------------------------ documents
def load(path: str | Path) -> dict:
    """A ``comm.json`` written by ``megasparse profile-comm``."""
    with open(path) as f:
        doc = json.load(f)
    if "runs" not in doc or "meta" not in doc:
        raise ValueError(f"{path}: not a profile-comm file (needs 'meta' and 'runs')")
    return doc


def run_records(doc: dict, label: str) -> list[dict]:
    """The counted (post-warm-up) records of one run of a profile document."""
    return counted(doc["runs"][label]["records"], int(doc["meta"].get("warmup_steps_excluded", 0)))


def summary(doc: dict) -> str:
    """The whole text report of a profile document: groups, classes and, with a dense run, ratios."""
    meta = doc["meta"]
    primary = meta["primary"]
    anchor = meta.get("anchor")
    warm = int(meta.get("warmup_steps_excluded", 0))
    steps = int(meta["steps"])
    lay = meta.get("layout", {})
    head = (
        f"## profile-comm: {primary} (filter.mode={meta.get('filter_mode')}, keep_ratio={meta.get('keep_ratio')}) "
        f"| world {meta.get('world_size')} = tp {lay.get('tp')} x pp {lay.get('pp')} x dp {lay.get('dp')}"
        f"{' +SP' if lay.get('sequence_parallel') else ''} | {meta.get('device')}\n\n"
        f"Bytes are each rank's payload (padding included; P2P counted by the sender), summed over all ranks and "
        f"steps {warm}..{steps - 1}" + (f" (first {warm} step(s) excluded as warm-up)." if warm else ".")
    )
    recs = run_records(doc, primary)
    if not recs:
        head += "\n\nNo transfers were recorded: a single rank (tp = pp = dp = 1) communicates nothing."
    parts = [head, f"### {primary}: per (phase, kind, group)", group_table(group_records(recs))]
    dense_cls = None
    if anchor:
        drecs = run_records(doc, anchor)
        dense_cls = class_totals(drecs)
        parts += [
            f"### {primary} vs {anchor}: bytes per (phase, kind, group)",
            compare_table(group_records(recs), group_records(drecs), label=primary),
        ]
    parts += ["### traffic classes", class_table(class_totals(recs), dense_cls, label=primary)]
    return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------- plot
def plot_comparison(
    filtered: dict[tuple, Totals],
    dense: dict[tuple, Totals],
    path: str | Path,
    label: str = "filtered",
    title: str = "",
) -> Path:
    """Grouped bars of MB per (phase, kind, group): dense next to filtered, ratio above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zero = Totals()
    ratios = byte_ratios(filtered, dense)
    keys = list(ratios)
    x = list(range(len(keys)))
    d = [dense.get(k, zero).bytes / 1e6 for k in keys]
    f = [filtered.get(k, zero).bytes / 1e6 for k in keys]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(keys) + 2), 4.5))
    w = 0.4
    ax.bar([i - w / 2 for i in x], d, w, label="dense", color="#7f7f7f")
    ax.bar([i + w / 2 for i in x], f, w, label=label, color="#1f77b4")
    for i, k in enumerate(keys):
        ax.annotate(_ratio_text(ratios[k]), (i, max(d[i], f[i])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(["\n".join(map(str, k)) for k in keys], fontsize=8)
    ax.set_ylabel("MB (all ranks, counted steps)")
    ax.set_title(title or f"communication volume: {label} vs dense ({label}/dense above bars)")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
