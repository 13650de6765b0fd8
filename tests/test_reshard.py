"""Resume across layouts (issue 14 item 4, docs/decisions/0902): a checkpoint saved at one tp × pp × dp layout
resumes at another with its weights, AdamW state and 2:4 masks, and the run continues like the uninterrupted one.

Each case trains layout A for STEPS steps, saving at step SAVE_AT, then resumes layout B from that checkpoint. Checks:
(1) exact — B saves again right after loading, and both checkpoints hold bitwise the same global tensors (every
parameter, exp_avg, exp_avg_sq, step, mask, counter); (2) B's losses for the remaining steps against A's, which
differ only by fp32 rounding: another TP/PP split sums in another order (see LOSS_TOL). (1) alone would pass a
global form that is wrong but consistent (e.g. a fused [q; k; v] saved as the concat of ranks); (2) and (3) catch
it: (3) where B also loads the weights as the reference model / inference do, B's ranks reassembled by
``consolidate.unshard`` equal the saved global tensors. unshard and the checkpoint's placement state the TP split
once (``shards.tp_pieces``), so (3) alone would pass a split that is wrong but consistent; the test of tp_pieces
below holds that statement to the layers' own ``chunk``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from tiny import tiny

STEPS, SAVE_AT = 5, 3
# vocab 130: padded to 192 at tp=1 and to 256 at tp=2, so the vocabulary matrices' padding differs between layouts
BASE = tiny(model__vocab_size=130, train__steps=STEPS, optim__warmup_steps=2) + ["parallel.backend=gloo"]
SPARSE = ["sparsity.enabled=true", "sparsity.backend=emulate", "sparsity.refresh_interval=2"]
# Measured max relative gap of B's losses to A's (torch 2.13, CPU): tp2sp-tp1 6.8e-9, tp1dp2-tp2 1.2e-8, pp2-pp1 0,
# tp2pp2vocab-1 4.6e-9, sparse-tp2-tp1 7.6e-9: fp32 summation order only, since the loaded state is bitwise equal.
# The 1e-6 holds with ~100x headroom.
LOSS_TOL = 1e-6


def _train(overrides: list[str], out: str, resume: str | None, weights: str | None = None) -> dict:
    """Train to STEPS (saving at SAVE_AT); with ``resume``: load it, save it again at once, then continue.

    ``weights`` loads ``resume`` a second time through ``load_weights``, as the online reference model does
    (``ref``: the whole model on this TP rank) or as inference does (``inference``: a tp = pp = 1 model)."""
    from megasparse.checkpoint import load_weights
    from megasparse.config import load_config
    from megasparse.model.builder import build_model, load_model_for_inference
    from megasparse.parallel.shards import global_name
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BASE + overrides + [f"logging.out_dir={out}"]))
    res: dict = {"losses": []}
    if resume:
        tr.resume(resume)
        tr.save()
    if weights == "ref":
        model = build_model(tr.cfg, tr.vocab, device=tr.device, compute_dtype=tr.compute_dtype, whole=True)
        load_weights(resume, model, model.layout)
    elif weights == "inference":
        model = load_model_for_inference(tr.cfg, resume).stage
    if weights:
        res["weights"] = {global_name(model, n): p.detach().clone() for n, p in model.named_parameters()}
        res["specs"] = {global_name(model, n): p.tp_spec for n, p in model.named_parameters() if hasattr(p, "tp_spec")}
    while tr.step < STEPS:
        res["losses"].append(tr.train_step().loss)
        if tr.step == SAVE_AT and not resume:
            tr.save()
    return res


def _global_tensors(ckpt_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    f = tmp / f"{ckpt_dir.parent.parent.name}.pt"
    dcp_to_torch_save(ckpt_dir, f)
    return torch.load(f, weights_only=False)


VOCAB_PP = ["loss.vocab_over_pp=true", "loss.embedding_over_pp=true"]
CASES = {  # name: (world A, overrides A, world B, overrides B, load_weights check in B)
    "tp2sp-tp1": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], 1, [], None),
    "tp1dp2-tp2": (2, [], 2, ["parallel.tp=2"], "ref"),
    "pp2-pp1": (2, ["parallel.pp=2"], 1, [], None),
    "pp2v2-pp1": (2, ["parallel.pp=2", "parallel.virtual_stages=2"], 1, [], None),  # interleaved chunks' global keys
    "tp2pp2vocab-1": (4, ["parallel.tp=2", "parallel.pp=2", *VOCAB_PP], 1, [], "inference"),
    "sparse-tp2-tp1": (2, ["parallel.tp=2", *SPARSE], 1, SPARSE, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout(tmp_path, case):
    world_a, ov_a, world_b, ov_b, weights = CASES[case]
    a, b = tmp_path / "a", tmp_path / "b"
    full = run_distributed(_train, world_a, ov_a, str(a), None)[0]["losses"]
    saved = a / "checkpoints" / f"step-{SAVE_AT}"
    ranks = run_distributed(_train, world_b, ov_b, str(b), str(saved), weights)
    rest = ranks[0]["losses"]

    from megasparse.checkpoint import read_layout

    assert read_layout(saved)["model"]["num_layers"] == 4, "the model shape is recorded at every layout"
    before, after = _global_tensors(saved, tmp_path), _global_tensors(b / "checkpoints" / f"step-{SAVE_AT}", tmp_path)
    assert sorted(before) == sorted(after)
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in before)
    if "sparsity.enabled=true" in ov_a:
        assert any(k.startswith("extra.mask.") for k in before)
    differ = [k for k in before if not torch.equal(before[k], after[k])]
    assert differ == [], f"resharded state differs from the saved one: {differ}"

    if weights:  # load_weights at another layout: B's ranks, reassembled by consolidate.unshard, equal the saved
        _check_weights(before, ranks)

    assert len(rest) == STEPS - SAVE_AT
    gap = max(abs(x - y) / abs(y) for x, y in zip(rest, full[SAVE_AT:]))
    print(f"{case}: max relative loss gap {gap:.2e}")
    assert gap <= LOSS_TOL, (case, gap, rest, full[SAVE_AT:])


def _check_weights(saved: dict[str, torch.Tensor], ranks: list[dict]) -> None:
    from megasparse.parallel.consolidate import unshard

    for name, first in ranks[0]["weights"].items():
        spec = ranks[0]["specs"].get(name)
        full = first if spec is None else unshard([r["weights"][name] for r in ranks], spec[0], spec[1])
        want = saved["model." + name]
        if full.shape[0] > want.shape[0]:  # vocabulary padding: zeros, not in the checkpoint
            assert not full[want.shape[0] :].any(), name
            full = full[: want.shape[0]]
        assert torch.equal(full, want), name


def _errors(out: str) -> dict[str, str]:
    import json

    from megasparse import checkpoint as ckpt
    from megasparse.config import ConfigError, load_config
    from megasparse.train import Trainer

    small = BASE + [f"logging.out_dir={out}", "model.num_layers=2"]
    tr = Trainer(load_config(None, small))
    tr.train_step()
    where = tr.save()
    errors = {}
    for name, ov in {"layers": ["model.num_layers=3"], "sparsity": SPARSE}.items():
        try:
            Trainer(load_config(None, small + ov)).resume(str(where))
        except ConfigError as e:
            errors[name] = str(e)
    sparse = Trainer(load_config(None, small + SPARSE + [f"logging.out_dir={out}/sparse"]))
    sparse.train_step()
    tr.resume(str(sparse.save()))  # 2:4 off at resume, on when saved: loads, the masks are not read
    errors["dense_from_sparse_step"] = str(tr.step)
    (where / ckpt.LAYOUT).unlink()  # what a checkpoint written before this format looks like
    sums = json.loads((where / ckpt.CHECKSUMS).read_text())
    (where / ckpt.CHECKSUMS).write_text(json.dumps({k: v for k, v in sums.items() if k != ckpt.LAYOUT}))
    try:
        tr.resume(str(where))
    except ConfigError as e:
        errors["old"] = str(e)
    return errors


def test_what_cannot_reshard_is_one_line(tmp_path):
    e = run_distributed(_errors, 1, str(tmp_path))[0]
    assert "does not match this run: model.num_layers is 2 there and 3 here" in e["layers"], e
    assert "does not match this run" in e["sparsity"] and "extra.mask.layers.0.mlp.fc1.weight" in e["sparsity"], e
    assert "written before checkpoints became layout-independent" in e["old"], e
    assert e["dense_from_sparse_step"] == "1"
    assert all("\n" not in v for v in e.values())


def test_tp_pieces_match_the_layers_split() -> None:
    """shards.tp_pieces (checkpoints, unshard) against the split the layers make: each partition chunked over TP."""
    from megasparse.parallel.consolidate import unshard
    from megasparse.parallel.shards import tp_pieces

    parts = [8, 4, 4]  # q | k | v of a fused GQA projection
    full = torch.arange(16.0 * 3).view(16, 3)
    for tp in (1, 2, 4):
        shards = [torch.cat([p.chunk(tp)[r] for p in full.split(parts)]) for r in range(tp)]
        for r, s in enumerate(shards):
            for local, start, n in tp_pieces(parts, tp, r):
                assert torch.equal(s[local : local + n], full[start : start + n])
        assert torch.equal(unshard(shards, 0, parts), full)
    with pytest.raises(ValueError, match="do not split"):
        unshard([full[:7], full[7:]], 0, parts)
