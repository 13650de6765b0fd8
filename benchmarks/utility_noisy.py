"""Does excess-loss token filtering keep noise out? Clean Shakespeare + 40% noisy documents, a clean reference.

    python benchmarks/utility_noisy.py                       # build the mix, train the reference and all runs
    python benchmarks/utility_noisy.py --plot-only           # re-read finished runs, plot and tabulate
    python benchmarks/utility_noisy.py --runs dense@1234 collider@1234 --jobs 1 --steps 20

The bundled Shakespeare documents are split (seeded, by document) into three disjoint pools: held-out (clean
validation windows every run is scored on), reference (clean text the reference model is trained on) and train.
In the train pool a share (``--noisy-share``, 40%) of the documents is replaced by noise a user would want
filtered, each as long in tokens as the document it replaces: the same tokens shuffled, character soup, or
repeated boilerplate. The pools are written as Megatron indexed datasets with the package's own writer, so
``megasparse train configs/utility_noisy_cpu.yaml data.prefix=OUT/data/mix`` trains on the mix; a per-document
kind array (``mix_kind.npy``, 0 = clean) records which documents are noise.

The reference is a dense run of the same model on the reference pool (``filter.reference=model``). Every run is
one single-process, one-thread Trainer in a child process (``--one``) so the script can hook
``trainer.filter.observer``: each micro-batch's samples are read through a wrapper that remembers which
documents their label tokens come from, and the observer counts the kept tokens per document kind. The trainer's
own validation split is swapped for the clean held-out pool, read in order, so every eval is on the same windows.
Writes JSON (every curve and count) and the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from utility_filtering import device_name, fmt, interp, mean, read_metrics  # noqa: E402

#: document kinds in the mix (index = code in mix_kind.npy)
KINDS = ("clean", "shuffled", "soup", "boilerplate")
#: variant -> trainer overrides ({ref} is the reference run's out_dir)
EXCESS = ["filter.scorer=excess", "filter.reference=model", "filter.ref_checkpoint={ref}"]
VARIANTS: dict[str, list[str]] = {
    "dense": ["filter.mode=off"],
    "loss_mask": ["filter.mode=loss_mask", *EXCESS],
    "collider": ["filter.mode=collider", *EXCESS],
    "collider_random": ["filter.mode=collider", "filter.scorer=random"],
    "collider_loss": ["filter.mode=collider", "filter.scorer=loss"],
    # not a filter: dense on the mix's clean documents only, the ceiling a perfect filter could approach
    "dense_clean": ["filter.mode=off"],
}
LABELS = {
    "dense": "dense (filter off)",
    "loss_mask": "loss_mask + excess",
    "collider": "collider + excess",
    "collider_random": "collider + random",
    "collider_loss": "collider + loss",
    "dense_clean": "dense on the clean documents only",
    "ref": "reference (clean pool)",
}
COLORS = {
    "dense": "black",
    "loss_mask": "tab:blue",
    "collider": "tab:red",
    "collider_random": "tab:gray",
    "collider_loss": "tab:orange",
    "dense_clean": "tab:purple",
}
REF = "ref"
DEFAULT_RUNS = [f"{v}@{s}" for s in (1234, 2345) for v in VARIANTS if v != "dense_clean"]

BOILERPLATE = (
    "This eBook is for the use of anyone anywhere at no cost and with almost no restrictions whatsoever. "
    "You may copy it, give it away or re-use it under the terms of the License included with this eBook.\n",
    "Home | About | Contact | Privacy Policy | Terms of Service | Subscribe to our newsletter | Log in\n",
    "We use cookies to improve your experience. By continuing to browse you agree to our use of cookies. "
    "Accept all cookies. Manage preferences.\n",
    "Copyright (c) All rights reserved. No part of this publication may be reproduced without permission.\n",
    "Click here to read more. Share on Facebook. Share on Twitter. Print this page. Back to top.\n",
)
SOUP_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()[]{}<>/\\|@#$%^&*_=+~ \n"


# ------------------------------------------------------------------------------------------------ data
def noise_document(kind: str, body: np.ndarray, encode: Callable[[str], list[int]], rng: np.random.Generator):
    """A noisy document as long as ``body`` (token ids, no EOD): ``body`` shuffled, character soup, boilerplate."""
    n = len(body)
    if kind == "shuffled":
        return rng.permutation(body)
    if kind == "soup":
        ids: list[int] = []
        while len(ids) < n:  # BPE merges little of random characters: about one token per 1-2 characters
            ids += encode("".join(rng.choice(list(SOUP_ALPHABET), size=2 * (n - len(ids)) + 16)))
        return np.asarray(ids[:n], dtype=np.int64)
    if kind == "boilerplate":
        start = int(rng.integers(len(BOILERPLATE)))  # one site's footer, repeated (a few lines rotate)
        lines = [BOILERPLATE[(start + i) % len(BOILERPLATE)] for i in range(2)]
        unit = encode("".join(lines))
        return np.resize(np.asarray(unit, dtype=np.int64), n)
    raise ValueError(f"unknown noise kind {kind!r}")


def split_pools(num_docs: int, heldout: int, reference: int, seed: int) -> dict[str, np.ndarray]:
    """Disjoint document ids (sorted) of the held-out, reference and train pools."""
    if heldout + reference >= num_docs:
        raise ValueError(f"{heldout} held-out + {reference} reference documents leave none of {num_docs} to train")
    perm = np.random.default_rng([seed, 0x0A1]).permutation(num_docs)
    return {
        "heldout": np.sort(perm[:heldout]),
        "reference": np.sort(perm[heldout : heldout + reference]),
        "train": np.sort(perm[heldout + reference :]),
    }


def make_mix(
    docs: list[np.ndarray],
    eod: int,
    encode: Callable[[str], list[int]],
    noisy_share: float,
    seed: int,
) -> tuple[list[np.ndarray], np.ndarray]:
    """(documents, kind codes): ``round(noisy_share · n)`` of ``docs`` replaced by equally long noise, the noise
    kinds dealt round-robin over them; every document ends with ``eod``. Document order is kept, so noisy and
    clean documents interleave wherever the seeded choice put them."""
    rng = np.random.default_rng([seed, 0x1015E])
    n_noisy = int(round(noisy_share * len(docs)))
    noisy = rng.permutation(len(docs))[:n_noisy]
    kinds = np.zeros(len(docs), dtype=np.int8)
    kinds[noisy] = 1 + np.arange(n_noisy) % (len(KINDS) - 1)
    out = []
    for d, k in zip(docs, kinds):
        body = d[:-1] if len(d) and d[-1] == eod else d
        if k:
            body = noise_document(KINDS[k], body, encode, rng)
        out.append(np.concatenate([np.asarray(body, dtype=np.int64), [eod]]))
    return out, kinds


def build_data(out: Path, a: argparse.Namespace) -> dict:
    """Write OUT/data/{mix,clean,reference,heldout}.{bin,idx} and mix_kind.npy once; returns the manifest."""
    from tokenizers import Tokenizer

    from megasparse.config import load_config
    from megasparse.data.builtin import ensure_builtin
    from megasparse.data.indexed import IndexedDataset, optimal_dtype, write_indexed
    from megasparse.data.tokenizer import tokenizer_info

    d = out / "data"
    man_path = d / "manifest.json"
    if man_path.exists() and not a.force:
        return json.loads(man_path.read_text())
    paths = ensure_builtin(vocab_size=load_config(a.config, a.override).data.tokenizer_vocab, builder=True)
    info = tokenizer_info(str(paths.tokenizer))
    tok = Tokenizer.from_file(str(paths.tokenizer))
    src = IndexedDataset(paths.prefix)
    pools = split_pools(len(src), a.heldout_docs, a.reference_docs, a.data_seed)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    dtype = optimal_dtype(info.vocab_size)
    for name in ("heldout", "reference"):
        write_indexed(d / name, (src[int(i)] for i in pools[name]), dtype)
    docs, kinds = make_mix(
        [np.asarray(src[int(i)]) for i in pools["train"]], info.eod_id, encode, a.noisy_share, a.data_seed
    )
    write_indexed(d / "mix", docs, dtype)
    write_indexed(d / "clean", (x for x, k in zip(docs, kinds) if k == 0), dtype)
    np.save(d / "mix_kind.npy", kinds)
    lens = np.array([len(x) for x in docs])
    man = {
        "source": paths.prefix,
        "tokenizer": str(paths.tokenizer),
        "data_seed": a.data_seed,
        "noisy_share_docs": a.noisy_share,
        "pools": {k: {"documents": len(v), "tokens": int(src.doc_lengths[v].sum())} for k, v in pools.items()},
        "mix": {
            KINDS[k]: {"documents": int((kinds == k).sum()), "tokens": int(lens[kinds == k].sum())}
            for k in range(len(KINDS))
        },
    }
    man["mix_noisy_token_share"] = 1 - man["mix"]["clean"]["tokens"] / int(lens.sum())
    man_path.write_text(json.dumps(man, indent=1))
    print(f"wrote {d}: {json.dumps(man['mix'])}", flush=True)
    return man


# ------------------------------------------------------------------------------------- noise accounting
class KindTracker:
    """Wraps the trainer's train split: remembers each sample's label-token kinds until its selection is seen.

    ``seen`` counts label tokens per kind as they are read; ``kept`` counts, per kind, the tokens each selection
    kept (``observe`` is the trainer's ``filter.observer``). Dense runs never select, so for them the trainer
    keeps everything and ``kept`` is ``seen``. Samples are matched to selections in reading order (one process,
    pp=1), and the tokens are compared so that a mismatch fails loudly instead of miscounting.
    """

    def __init__(self, ds, doc_kinds: np.ndarray, selecting: bool):
        self.ds, self.selecting = ds, selecting
        self.token_kind = np.repeat(doc_kinds.astype(np.int8), ds.indexed.doc_lengths)  # aligned with the .bin
        self.pending: deque = deque()
        self.seen = np.zeros(len(KINDS), dtype=np.int64)
        self.kept = np.zeros(len(KINDS), dtype=np.int64)
        self.trace: list[tuple[int, int]] = []  # (noisy, total) gradient tokens per sample read or selection

    def __len__(self) -> int:
        return len(self.ds)

    def __getattr__(self, name: str):
        return getattr(self.ds, name)

    def global_sample(self, g: int, seed: int | None = None):
        import torch

        epoch, k = divmod(g, self.ds.num_samples)
        i = int(self.ds.epoch_order(epoch, seed)[k])
        pos = self.ds.positions(i)
        kind = np.where(pos >= 0, self.token_kind[np.maximum(pos, 0)], 0)[1:]  # label tokens; inserted EOD: clean
        self.seen += np.bincount(kind, minlength=len(KINDS))
        if not self.selecting:  # dense: every label token gets gradient
            self.trace.append((int((kind > 0).sum()), len(kind)))
        sample = self.ds[i]
        if self.selecting:
            self.pending.append((sample, torch.from_numpy(kind.astype(np.int64))))
        return sample

    def observe(self, tokens, sel):
        """``tokens`` [b, s+1]; ``sel.mask`` [s, b] (s-major): count kept (and valid) label tokens per kind.

        Returns the kind codes it attributed to the label positions, ``[s, b]`` (for tests)."""
        import torch

        rows = [self.pending.popleft() for _ in range(tokens.shape[0])]
        if not all(torch.equal(t, r.cpu()) for (t, _), r in zip(rows, tokens)):
            raise RuntimeError("selection observed for a micro-batch other than the one read last")
        kind = torch.stack([k for _, k in rows]).t()  # [s, b]
        kept = kind[sel.loss_mask.cpu()]
        self.kept += np.bincount(kept.numpy(), minlength=len(KINDS))
        self.trace.append((int((kept > 0).sum()), len(kept)))
        return kind

    def counts(self) -> dict:
        kept = self.kept if self.selecting else self.seen
        half = self.trace[len(self.trace) // 2 :]
        late = sum(n for n, _ in half) / max(1, sum(t for _, t in half))
        return {
            "seen": dict(zip(KINDS, self.seen.tolist())),
            "kept": dict(zip(KINDS, kept.tolist())),
            "kept_noisy_share_second_half": late,
            "trace": [
                b.sum(axis=0).tolist()
                for b in np.array_split(np.asarray(self.trace).reshape(-1, 2), min(50, len(self.trace)))
            ],
        }


def noisy_share(counts: dict, which: str) -> float:
    c = counts[which]
    total = sum(c.values())
    return (total - c["clean"]) / total if total else float("nan")


# ------------------------------------------------------------------------------------------------ runs
def run_overrides(a: argparse.Namespace, name: str, seed: int, run_dir: Path) -> list[str]:
    data = Path(a.out) / "data"
    if name == REF:
        over = ["filter.mode=off", f"data.prefix={data / 'reference'}", "checkpoint.save_at_end=true"]
        steps = a.ref_steps
    else:
        over = [o.format(ref=Path(a.out) / REF) for o in VARIANTS[name]] + [
            f"data.prefix={data / ('clean' if name == 'dense_clean' else 'mix')}"
        ]
        steps = a.steps
    return [
        *over,
        f"filter.keep_ratio={a.keep}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        f"train.eval_interval={a.eval_interval}",
        f"train.eval_batches={a.eval_batches}",
        f"logging.out_dir={run_dir}",
        *a.override,
    ]


def heldout_dataset(a: argparse.Namespace, cfg):
    """The clean held-out pool as a validation split: all its documents, windows read in order."""
    from megasparse.data.dataset import PackedDataset
    from megasparse.data.indexed import IndexedDataset
    from megasparse.data.tokenizer import tokenizer_info

    idx = IndexedDataset(Path(a.out) / "data" / "heldout")
    eod = tokenizer_info(json.loads((Path(a.out) / "data" / "manifest.json").read_text())["tokenizer"]).eod_id
    ds = PackedDataset(idx, np.arange(len(idx)), cfg.model.seq_length, eod, shuffle=False, name="heldout")
    need = cfg.train.eval_batches * cfg.num_microbatches(1) * cfg.train.micro_batch_size
    if need > len(ds):  # evaluate() would wrap around to the same windows
        raise SystemExit(f"--eval-batches asks for {need} held-out windows; the held-out pool has {len(ds)}")
    return ds


def train_one(a: argparse.Namespace, name: str, seed: int, run_dir: Path) -> dict:
    """One run in this process (world 1, gloo): held-out swapped in, kinds tracked; writes run_dir/noise.json."""
    import torch

    from megasparse.config import load_config
    from megasparse.parallel import state
    from megasparse.train import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
    torch.set_num_threads(1)
    cfg = load_config(a.config, run_overrides(a, name, seed, run_dir))
    tr = Trainer(cfg)
    try:
        tr.valid_ds = heldout_dataset(a, cfg)
        if name != REF:
            kinds = np.load(Path(a.out) / "data" / "mix_kind.npy")
            if name == "dense_clean":
                kinds = np.zeros(len(tr.train_ds.indexed), dtype=np.int8)
            tracker = KindTracker(tr.train_ds, kinds, selecting=cfg.filter.mode != "off")
            tr.train_ds = tracker
            if tr.filter is not None:  # the TokenFilter calls it with (Batch, KeepMask) after every selection
                tr.filter.observer = lambda batch, sel: tracker.observe(batch.tokens, sel)
        t0 = time.time()
        tr.fit()
        res = {"run": f"{name}@{seed}", "wall_s": round(time.time() - t0, 1)}
        if name != REF:
            res.update(tracker.counts())
        (run_dir / "noise.json").write_text(json.dumps(res, indent=1))
        return res
    finally:
        state.destroy()


def parse_run(spec: str) -> tuple[str, int]:
    name, _, seed = spec.partition("@")
    if name not in VARIANTS and name != REF:
        raise SystemExit(f"--runs {spec}: unknown variant {name!r}; use one of {', '.join(VARIANTS)}")
    return name, int(seed or 1234)


def finished(run_dir: Path, steps: int) -> bool:
    recs = read_metrics(run_dir / "metrics.jsonl")
    return bool(recs) and recs[-1].get("step") == steps and (run_dir / "noise.json").exists()


def run_all(a: argparse.Namespace, runs: list[tuple[str, int]], argv: list[str]) -> dict[str, dict]:
    """Each run is a child ``--one`` process (one thread), ``--jobs`` at a time; returns rc and wall time."""
    pending, live, status = list(runs), {}, {}
    while pending or live:
        while pending and len(live) < a.jobs:
            name, seed = pending.pop(0)
            key = f"{name}@{seed}"
            run_dir = Path(a.out) / (REF if name == REF else f"{name}_s{seed}")
            if finished(run_dir, a.ref_steps if name == REF else a.steps) and not a.force:
                status[key] = {"rc": 0, "skipped": "already finished"}
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            cmd = [sys.executable, __file__, *argv, "--one", key]
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            print(f"start {key}", flush=True)
            with open(run_dir / "train.log", "w") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            live[key] = (proc, time.time(), run_dir)
        time.sleep(1.0)
        for key in [k for k, (p, _, _) in live.items() if p.poll() is not None]:
            proc, t0, run_dir = live.pop(key)
            lines = (run_dir / "train.log").read_text().strip().splitlines()
            err = lines[-1] if proc.returncode and lines else None
            status[key] = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "error": err}
            print(
                f"done  {key}: rc {proc.returncode} in {time.time() - t0:.0f}s" + (f" ({err})" if err else ""),
                flush=True,
            )
    return status


# ------------------------------------------------------------------------------------------ results
def collect(a: argparse.Namespace, runs: list[tuple[str, int]], status: dict) -> dict[str, dict]:
    out = {}
    for name, seed in runs:
        key = f"{name}@{seed}"
        run_dir = Path(a.out) / (REF if name == REF else f"{name}_s{seed}")
        recs = read_metrics(run_dir / "metrics.jsonl")
        ev = [r for r in recs if "val_loss" in r]
        entry = {"variant": name, "seed": seed, **status.get(key, {})}
        if ev:
            entry.update(
                steps=[r["step"] for r in recs],
                train_loss=[r["loss"] for r in recs],
                val_steps=[r["step"] for r in ev],
                val_loss=[r["val_loss"] for r in ev],
            )
        if (run_dir / "noise.json").exists():
            entry.update(json.loads((run_dir / "noise.json").read_text()))
        out[key] = entry
    return out


def grad_tokens_per_step(cfg_path: str, mode: str, keep: float, granularity: str) -> int:
    from megasparse.config import load_config
    from megasparse.filtering.selection import kept_total

    cfg = load_config(cfg_path)
    s, b = cfg.model.seq_length, cfg.train.micro_batch_size
    mbs = cfg.num_microbatches(1)
    return s * b * mbs if mode == "off" else kept_total((s, b), keep, granularity, 1) * mbs


def summary(res: dict[str, dict], a: argparse.Namespace) -> list[dict]:
    """Per variant: final held-out loss per seed, mean, half range; kept noisy share; Δ vs dense mean."""
    from megasparse.config import load_config

    gran = load_config(a.config, a.override).filter.granularity
    by: dict[str, list[dict]] = {}
    for r in res.values():
        if r.get("val_loss") and r["variant"] != REF:
            by.setdefault(r["variant"], []).append(r)
    dense = [r["val_loss"][-1] for r in by.get("dense", [])]
    rows = []
    for v, rs in by.items():
        finals = [r["val_loss"][-1] for r in rs]
        mode = "off" if v.startswith("dense") else "collider" if v.startswith("collider") else "loss_mask"
        gt = grad_tokens_per_step(a.config, mode, a.keep, gran)
        row = {
            "variant": v,
            "seeds": [r["seed"] for r in rs],
            "final_val": finals,
            "mean": mean(finals),
            "half_range": (max(finals) - min(finals)) / 2,
            "d_vs_dense": mean(finals) - mean(dense) if dense else None,
            "grad_tokens_per_step": gt,
            "kept_noisy_share": [noisy_share(r, "kept") for r in rs if "kept" in r],
            "kept_noisy_share_second_half": [r["kept_noisy_share_second_half"] for r in rs if "kept" in r],
            "seen_noisy_share": [noisy_share(r, "seen") for r in rs if "seen" in r],
            "kept_by_kind": [r["kept"] for r in rs if "kept" in r],
        }
        rows.append(row)
    order = list(VARIANTS)
    return sorted(rows, key=lambda r: order.index(r["variant"]))


def print_summary(rows: list[dict], ref: dict | None, device: str) -> None:
    cols = (
        f"{'variant':<20} {'final held-out per seed':>24} {'mean':>7} {'±':>6} {'Δ dense':>8} "
        f"{'grad tok/step':>13} {'noisy share kept':>17} {'2nd half':>8} {'in batches':>10}"
    )
    print(f"\nclean held-out loss at the last step (nats/token), device {device}\n{cols}\n{'-' * len(cols)}")
    for r in rows:
        per = " ".join(f"{x:.4f}" for x in r["final_val"])
        kept = " ".join(f"{x:.3f}" for x in r["kept_noisy_share"])
        seen = mean(r["seen_noisy_share"]) if r["seen_noisy_share"] else None
        late = mean(r["kept_noisy_share_second_half"]) if r["kept_noisy_share_second_half"] else None
        print(
            f"{r['variant']:<20} {per:>24} {r['mean']:>7.4f} {r['half_range']:>6.4f} "
            f"{fmt(r['d_vs_dense'], '+8.4f')} {r['grad_tokens_per_step']:>13} {kept:>17} "
            f"{fmt(late, '8.3f')} {fmt(seen, '10.3f')}"
        )
    if ref and ref.get("val_loss"):
        print(f"reference model (dense on the clean reference pool): held-out {ref['val_loss'][-1]:.4f}")


def markdown(rows: list[dict], res: dict[str, dict], at: tuple[int, ...] = (50, 100, 150, 200, 250, 300)) -> str:
    """The doc's tables: final held-out loss and noise shares per variant; mean held-out loss at some steps."""
    out = [
        "| run | final held-out, per seed | mean ± half range | Δ vs dense | gradient tokens / step "
        "| noisy share of gradient tokens (whole run / 2nd half) | shuffled / soup / boilerplate share |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kinds = {k: sum(c[k] for c in r["kept_by_kind"]) for k in KINDS} if r["kept_by_kind"] else None
        total = sum(kinds.values()) if kinds else 0
        per_kind = " / ".join(f"{kinds[k] / total:.3f}" for k in KINDS[1:]) if total else "-"
        share = (f"{mean(r['kept_noisy_share']):.3f} / {mean(r['kept_noisy_share_second_half']):.3f}"
                 if r["kept_noisy_share"] else "-")  # fmt: skip
        out.append(
            f"| {LABELS[r['variant']]} | {' / '.join(f'{x:.4f}' for x in r['final_val'])} | {r['mean']:.4f} ± "
            f"{r['half_range']:.4f} | {fmt(r['d_vs_dense'], '+.4f')} | {r['grad_tokens_per_step']} | {share} "
            f"| {per_kind} |"
        )
    out += ["", "| run (mean over seeds) | " + " | ".join(f"step {s}" for s in at) + " |",
            "|---|" + "---:|" * len(at)]  # fmt: skip
    for r in rows:
        runs = [x for x in res.values() if x["variant"] == r["variant"] and x.get("val_loss")]
        cells = []
        for s in at:
            v = [dict(zip(x["val_steps"], x["val_loss"])).get(s) for x in runs]
            cells.append(f"{mean(v):.3f}" if v and None not in v else "-")
        out.append(f"| {LABELS[r['variant']]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(res: dict[str, dict], rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    styles = ["-", "--", ":", "-."]
    seen: dict[str, int] = {}
    dense = [r for r in res.values() if r["variant"] == "dense" and r.get("val_loss")]
    dsteps = sorted(set.intersection(*(set(r["val_steps"]) for r in dense))) if dense else []
    dmean = [mean([dict(zip(r["val_steps"], r["val_loss"]))[s] for r in dense]) for s in dsteps]
    for r in res.values():
        if not r.get("val_loss"):
            continue
        v = r["variant"]
        if v == REF:
            ax[0].axhline(r["val_loss"][-1], color="tab:green", lw=1, ls="--", label=LABELS[REF])
            continue
        ls = styles[seen.get(v, 0) % len(styles)]
        seen[v] = seen.get(v, 0) + 1
        lab = f"{LABELS[v]} (seed {r['seed']})"
        ax[0].plot(r["val_steps"], r["val_loss"], ls, color=COLORS[v], label=lab, lw=1.3)
        if v != "dense" and dsteps:
            d = [y - interp(x, dsteps, dmean) for x, y in zip(r["val_steps"], r["val_loss"]) if x in dsteps]
            ax[1].plot([x for x in r["val_steps"] if x in dsteps], d, ls, color=COLORS[v], label=lab, lw=1.3)
    ax[1].axhline(0, color="black", lw=0.8)
    vals = [v for r in res.values() if r["variant"] != REF for v in r.get("val_loss", [])]
    if vals:
        ax[0].set_ylim(min(vals) - 0.05, min(max(vals), min(vals) + 2.0))
    ax[0].set(xlabel="optimizer step", ylabel="clean held-out loss (nats/token)", title="held-out loss vs step")
    ax[1].set(xlabel="optimizer step", ylabel="held-out loss − dense mean (nats)", title="difference to dense")
    seen.clear()
    for r in res.values():  # noisy share of the gradient tokens over training (50 bins of equal reads)
        if not r.get("trace") or not r.get("steps"):
            continue
        v = r["variant"]
        ls = styles[seen.get(v, 0) % len(styles)]
        seen[v] = seen.get(v, 0) + 1
        tr = np.asarray(r["trace"], dtype=np.float64)
        xs = (np.arange(len(tr)) + 0.5) / len(tr) * r["steps"][-1]
        ax[2].plot(
            xs, tr[:, 0] / np.maximum(tr[:, 1], 1), ls, color=COLORS[v], lw=1.2, label=f"{LABELS[v]} (seed {r['seed']})"
        )
    share = [s for r in rows if r["variant"] != "dense_clean" for s in r["seen_noisy_share"]]
    if share:
        ax[2].axhline(mean(share), color="black", ls=(0, (1, 3)), lw=1, label="share of the tokens read")
    ax[2].set_ylim(bottom=0)
    ax[2].set(xlabel="optimizer step", ylabel="share from noisy documents", title="noise in the gradient tokens")
    for axis in ax:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "utility_noisy_cpu.yaml"))
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="variant@seed ...; variants: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ref-steps", type=int, default=300, help="steps of the reference model on the clean pool")
    p.add_argument("--ref-seed", type=int, default=4321)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--keep", type=float, default=0.6)
    p.add_argument("--noisy-share", type=float, default=0.4, help="share of the train pool's documents made noise")
    p.add_argument("--heldout-docs", type=int, default=60)
    p.add_argument("--reference-docs", type=int, default=400)
    p.add_argument("--data-seed", type=int, default=1234, help="seed of the pools and the noise")
    p.add_argument("--out", default=str(REPO / "runs" / "utility_noisy"))
    p.add_argument("--jobs", type=int, default=1, help="trainings at once (each one thread)")
    p.add_argument("--force", action="store_true", help="rebuild the data and rerun finished runs")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: train this variant@seed in-process
    p.add_argument("--img", default=str(REPO / "docs" / "img" / "utility_noisy.png"))
    p.add_argument("--json", default=None, help="default OUT/utility_noisy.json")
    p.add_argument("override", nargs="*", help="extra trainer overrides for every run (key.sub=value)")
    a = p.parse_args(argv)
    a.out = str(Path(a.out).resolve())
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.one:
        name, seed = parse_run(a.one)
        train_one(a, name, seed, Path(a.out) / (REF if name == REF else f"{name}_s{seed}"))
        return 0
    runs = [parse_run(s) for s in a.runs]
    child_argv = [x for x in argv if x != "--force"]  # the parent already rebuilt what --force asked for
    status: dict = {}
    if not a.plot_only:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        build_data(Path(a.out), a)
        if any("filter.scorer=excess" in VARIANTS[n] for n, _ in runs):  # only excess runs need the reference
            status = run_all(a, [(REF, a.ref_seed)], child_argv)
        if status.get(f"{REF}@{a.ref_seed}", {}).get("rc"):
            raise SystemExit(f"training the reference failed; see {Path(a.out) / REF / 'train.log'}")
        status.update(run_all(a, runs, child_argv))
    res = collect(a, [(REF, a.ref_seed), *runs], status)
    rows = summary(res, a)
    device = device_name()
    man = json.loads((Path(a.out) / "data" / "manifest.json").read_text())
    title = (
        f"{Path(a.config).name}: {a.steps} steps, keep {a.keep}, {man['mix_noisy_token_share']:.0%} noisy tokens "
        f"in the mix, reference = same model on a disjoint clean pool ({a.ref_steps} steps) | {device}"
    )
    plot(res, rows, a.img, title)
    js = a.json or str(Path(a.out) / "utility_noisy.json")
    meta = {k: getattr(a, k) for k in ("config", "steps", "ref_steps", "keep", "eval_interval", "eval_batches")}
    with open(js, "w") as f:
        json.dump({"device": device, **meta, "data": man, "summary": rows, "runs": res}, f, indent=1)
    print(f"wrote {js}")
    print_summary(rows, res.get(f"{REF}@{a.ref_seed}"), device)
    print("\n" + markdown(rows, res))
    return 0 if all(s.get("rc") in (0, None) for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
