"""The trainer: ``megasparse train CONFIG.yaml [section.key=value ...]`` (also under torchrun / Slurm).

Order of business: load and validate the whole config against the world size (before any process
group exists), build the data, create the groups, build this rank's pipeline stage, then run
steps of 1F1B over micro-batches, reduce gradients over DP in buckets that overlap the backward (and the
SP-replicated norms over TP), clip, step AdamW (replicated or sharded over DP) with warmup + cosine, log,
evaluate and checkpoint.

Features plug in rather than being wired here: the model comes from ``model/builder.py``, token filtering is a
``filtering/component.py`` TokenFilter fed by ``data/batch.py`` Batches, 2:4 sparsity a
``sparse24/converter.py`` converter with optimizer hooks, gradient buckets, norm and the (distributed) optimizer
in ``parallel/ddp.py`` and ``parallel/dist_optim.py`` (docs/decisions/0403, 0404).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megasparse import checkpoint as ckpt
from megasparse import runguard
from megasparse.banner import RunFacts, format_banner
from megasparse.config import Config, dump_config, load_config
from megasparse.cudagraph import CapturedSteps
from megasparse.data.batch import Batch
from megasparse.data.dataset import build_data, iterate_batches
from megasparse.filtering.component import TokenFilter
from megasparse.fp8.converter import fp8_converter
from megasparse.guard import NonFiniteGuard
from megasparse.loss import pipeline as vocab_pp
from megasparse.metrics import MetricsLog, Progress, flops_per_token, format_line, peak_tflops, step_record
from megasparse.model.builder import build_model, resolve_device, resolve_dtype
from megasparse.ops.compact import KeepHolder
from megasparse.optim import build_data_parallel, lr_at
from megasparse.parallel import comm, state
from megasparse.parallel.pipeline import P2PSpec, StageComm, catch_grad, forward_only, lockstep, one_f_one_b
from megasparse.sparse24.converter import Sparse24Converter

__all__ = ["StepResult", "Trainer", "main", "run_training"]


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


# ---------------------------------------------------------------------------------------- trainer
@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)


class Trainer:
    """One rank's view of a run. ``Trainer(cfg).fit()`` or step by step with ``train_step()``."""

    def __init__(self, cfg: Config, init_groups: bool = True):
        self.cfg = cfg
        world = state.world_env()[1]
        self.dp = cfg.validate(world)
        self.train_ds, self.valid_ds, self.vocab = build_data(cfg)
        if init_groups:
            p = cfg.parallel
            state.init(p.tp, p.pp, p.sequence_parallel, cfg.dist_backend(), p.timeout_minutes * 60)
        self.lay = state.layout()
        self.device = resolve_device(cfg)
        self.compute_dtype = resolve_dtype(cfg, self.device)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.vocab_padded = cfg.padded_vocab(self.vocab)
        m = cfg.model
        self.model = build_model(cfg, self.vocab, device=self.device, compute_dtype=self.compute_dtype)
        if cfg.checkpoint.init_from:  # other weights at step 0, before buckets and 2:4 masks read them
            from megasparse.hf.convert import init_from

            init_from(cfg.checkpoint.init_from, self.model, m, self.vocab)
        self.graphs = CapturedSteps(cfg, self.lay.pp, self.device, self.model)  # train.cuda_graphs
        # gradient buckets over DP and AdamW on them (sharded under parallel.distributed_optimizer): before the 2:4
        # converter, so its masks and operands see the parameters in their final dtype and storage
        eager = self.graphs.blocker is not None
        self.dp_opt = build_data_parallel(self.model, cfg, self.device, self.compute_dtype, eager)
        self.optimizer = self.dp_opt.optimizer
        self.sparsity = None  # the 2:4 converter: FFN GEMMs, decay / refresh hooks, masks in the checkpoint
        if cfg.sparsity.enabled:
            self.sparsity = Sparse24Converter(cfg.sparsity, cfg.train.steps, self.compute_dtype)
            self.sparsity.convert(self.model)
        self.fp8 = fp8_converter(cfg, self.model, self.device)  # train.fp8: qkv/proj/fc1/fc2 in fp8 (None: off)
        self.dp_opt.keep_compute_copies()  # bf16 weights cast once per optimizer step, not per micro-batch
        self.num_mb = cfg.num_microbatches(self.dp)
        s_local = m.seq_length // cfg.parallel.sp_shards
        self.act_shape = (s_local, cfg.train.micro_batch_size, m.hidden_size)
        dev, dt, last = self.device, self.compute_dtype, self.lay.is_last_stage
        self.filter = TokenFilter.from_config(cfg, self.train_ds, self.vocab, dev, dt, last)  # None: mode off
        kept = self.filter.kept_rows if self.filter is not None and self.filter.collider else None
        kept_fn = None if kept is None else (lambda: kept)
        spec = P2PSpec(self.act_shape, self.compute_dtype, self.device, kept_fn, cfg.train.micro_batch_size)
        if kept is not None:  # what the selection fixes by shape: receivers post compact rows without waiting
            spec.seq_count, spec.shards = self.filter.seq_count, self.filter.shards
        self.vocab_peer = None  # loss.vocab_over_pp on a non-last stage: its slice of every micro-batch's loss
        if self.model.vocab_pp and not self.lay.is_last_stage:
            self.vocab_peer = vocab_pp.VocabPPPeer(
                self.model.output_weight,
                cfg.loss,
                vocab_start=self.model.vocab_start,
                vocab_size=self.vocab,
                rows=m.seq_length * cfg.train.micro_batch_size,
                compute_dtype=self.compute_dtype,
                kept_rows=kept,
            )
        self.p2p = StageComm(spec, cfg.parallel.virtual_stages)  # v > 1: one_f_one_b interleaves the chunks
        self.step = 0
        self.consumed = 0
        self.guard = NonFiniteGuard(cfg.train.max_skipped_steps)  # reliability: skip non-finite steps
        self.flops_tok = flops_per_token(m, self.vocab_padded)
        self.peak = peak_tflops(self.device)
        self.out_dir = Path(cfg.logging.out_dir)

    # -- batches ---------------------------------------------------------------------------------
    def _microbatches(self, ds, start: int, count: int) -> list[Batch]:
        it = iterate_batches(ds, self.cfg.train.micro_batch_size, self.lay.dp_rank, self.dp, start)
        return [next(it).to(self.device, pin=self.device.type == "cuda") for _ in range(count)]

    # -- one optimizer step ---------------------------------------------------------------------
    def _forward_backward(self, batches: list[Batch], train: bool) -> tuple[float, int]:
        """Run the pipeline over ``batches``; returns (sum of per-token losses on this rank, tokens)."""
        tokens_per_mb = self.cfg.train.micro_batch_size * self.cfg.model.seq_length
        filtering = train and self.filter is not None
        per_mb = self.filter.kept_rows if filtering else tokens_per_mb
        normaliser = per_mb * self.num_mb * self.dp  # kept (or all) tokens of the global batch
        acc = {"loss": torch.zeros((), dtype=torch.float64, device=self.device)}

        emb_pp = self.model.embedding if self.model.embedding_pp else None
        inputs = None  # embedding_over_pp: the first stage's inputs of every micro-batch, looked up at once
        caught: list[dict] = [{} for _ in batches]  # the first stage's input gradients under embedding_over_pp
        if emb_pp is not None:
            inputs = emb_pp.lookup_all([b.tokens[:, :-1].t() for b in batches], requires_grad=train)
            if inputs is not None and train:
                inputs = [catch_grad(x, c) for x, c in zip(inputs, caught)]

        def forward_step(i: int, x: torch.Tensor | None, chunk: int = 0, batch: Batch | None = None) -> torch.Tensor:
            batch = batches[i] if batch is None else batch
            ids = batch.ids if inputs is None else inputs[i]
            keep, stage = KeepHolder(), self.model.chunks[chunk]  # virtual stages: this rank's chunk `chunk`
            out = stage(ids if stage.first else x, batch.targets, keep)
            if not stage.last:
                return out
            acc["loss"] += out.detach().double().sum()
            if not filtering:
                return out.sum() / normaliser
            return self.filter.masked_loss(out, batch, keep, self.step, self.lay.dp_rank + i * self.dp) / normaliser

        def backward_step(i: int, out: torch.Tensor, g: torch.Tensor | None) -> None:
            torch.autograd.backward(out, g)

        replay = lambda b: backward_step(0, forward_step(0, None, 0, b), None)  # noqa: E731
        if train and self.lay.pp == 1 and self.graphs.run(batches, replay, acc, self.step):  # one graph, replayed
            pass
        elif train and self.model.vocab_pp:  # the output layer's slices meet once per micro-batch: lock step
            peer = self.vocab_peer
            slot = None if peer is None else lambda k: peer.step(batches[k].targets, train=True)
            lockstep(len(batches), self.p2p, forward_step, backward_step, slot)
            if emb_pp is not None:
                emb_pp.backward_all(None if inputs is None else [c.get("grad") for c in caught])
        elif train:  # pp > 1: each stage's micro-batches replay its captured graphs between eager transfers
            graphs = self.graphs.stage(batches, self.p2p, forward_step, backward_step, acc, self.step)
            one_f_one_b(len(batches), self.p2p, forward_step, backward_step, graphs)
        else:
            peer = self.vocab_peer  # loss.vocab_over_pp: this stage's slice joins each micro-batch's loss
            after = None if peer is None else lambda i: peer.step(batches[i].targets, train=False)
            with torch.no_grad():
                forward_only(len(batches), self.p2p, forward_step, after)
        return acc["loss"], tokens_per_mb * len(batches)

    def _global_mean(self, loss_sum: torch.Tensor, tokens: int) -> float:
        """Mean loss over every DP rank's tokens, known on every rank (sent from the last stage)."""
        t = torch.stack([loss_sum.double(), torch.tensor(float(tokens), dtype=torch.float64, device=self.device)])
        if not self.lay.is_last_stage:
            t.zero_()
        with comm.phase("metrics"):
            comm.all_reduce(t, None, "world", region="metrics.loss")
        return (t[0] / t[1]).item()

    def compute_gradients(self) -> tuple[torch.Tensor, int]:
        """Forward + backward of this step's global batch; leaves fully reduced gradients in the DP buckets."""
        self.dp_opt.zero_grad(self.num_mb)
        batches = self._microbatches(self.train_ds, self.consumed, self.num_mb)
        loss_sum, tokens = self._forward_backward(batches, train=True)
        self.dp_opt.reduce()
        return loss_sum, tokens

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        lr = lr_at(self.cfg, self.step)
        for g in self.dp_opt.param_groups:
            g["lr"] = lr
        loss_sum, tokens = self.compute_gradients()
        gnorm = self.dp_opt.grad_norm()
        loss = self._global_mean(loss_sum, tokens)
        # reliability: a non-finite step is skipped before clipping/decay/optimizer.step touch any state
        if self.guard.check(self.step + 1, loss, gnorm, log0):
            self.dp_opt.zero_grad()
            self.step += 1
            self.consumed += self.cfg.train.global_batch_size
            return StepResult(loss, gnorm, lr, tokens, time.perf_counter() - t0, {"skipped": self.guard.total})
        self.dp_opt.clip(gnorm, self.cfg.optim.grad_clip)
        if self.sparsity is not None:
            self.sparsity.pre_optimizer_step(self.dp_opt.optimizer)
        self.dp_opt.step(wait=self.sparsity is not None or self.fp8 is not None)  # their hooks read whole weights
        extra = {} if self.sparsity is None else self.sparsity.post_optimizer_step(self.step + 1)
        if self.fp8 is not None:
            self.fp8.post_optimizer_step()  # the fp8 weight copies, once per step
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        return StepResult(loss, gnorm, lr, tokens, time.perf_counter() - t0, extra)

    @torch.no_grad()
    def evaluate(self) -> float:
        n = self.cfg.train.eval_batches * self.num_mb
        batches = self._microbatches(self.valid_ds, 0, n)
        loss_sum, tokens = self._forward_backward(batches, train=False)
        return self._global_mean(loss_sum, tokens)

    # -- checkpoints ----------------------------------------------------------------------------
    def _extra(self) -> dict:
        extra = {"step": torch.tensor(self.step), "consumed": torch.tensor(self.consumed)}
        if self.sparsity is not None:  # masks travel with the weights
            extra.update(self.sparsity.extra_state())
        return extra

    def save(self) -> Path | None:
        with self.dp_opt.checkpoint_view() as opt:  # the plain AdamW structure, gathered over DP when sharded
            return ckpt.save(
                self.out_dir / "checkpoints", self.step, self.model, opt, self._extra(), self.cfg.checkpoint.keep_last,
                run=runguard.run_record(self.cfg),
            )  # fmt: skip

    def resume(self, path: str, guard: runguard.RunGuard | None = None) -> None:
        where = ckpt.resolve_resume(path)
        if guard is not None:
            guard.check_resume(where, ckpt.saved_step(where))
        with self.dp_opt.checkpoint_view(load=True) as opt:
            extra = ckpt.load(where, self.model, opt, self._extra())
        self.step, self.consumed = int(extra["step"]), int(extra["consumed"])
        if self.sparsity is not None:
            self.sparsity.load_extra_state(extra, self.step)
        log0(f"resumed from {where} at step {self.step}")

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        guard = runguard.RunGuard(self.cfg, self.device, log0)  # lock, start checks, signals (issue 32)
        try:
            return self._fit(guard)
        finally:
            guard.close()

    def _fit(self, guard: runguard.RunGuard) -> list[dict]:
        cfg = self.cfg
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        resume = ckpt.resume_target(cfg.checkpoint.resume, self.out_dir, log0)  # reliability: resume=auto
        guard.start(self.model, resume)
        if resume:
            self.resume(resume, guard)
        if rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out_dir / "config.yaml")
        log = MetricsLog(
            str(self.out_dir),
            rank0,
            resume_step=self.step if resume else None,
            tensorboard=cfg.logging.tensorboard,
            wandb_project=cfg.logging.wandb_project,
            config=cfg.to_dict(),
        )
        n_world = dist.get_world_size() if dist.is_initialized() else 1
        kept = None if self.filter is None else self.filter.kept_rows
        facts = RunFacts(
            n_world, self.dp, self.vocab, self.vocab_padded, self.device, self.compute_dtype, self.num_mb, kept,
            self.dp_opt.state_bytes() / 2**20, self.dp_opt.sharded, self.graphs.blocker,
        )  # fmt: skip
        log0(format_banner(cfg, facts))
        progress = Progress(cfg.train.steps)
        kept_share = None if kept is None else kept / (cfg.model.seq_length * cfg.train.micro_batch_size)
        history = []
        while self.step < cfg.train.steps:
            guard.step(self.step)
            r = self.train_step()
            tok_s = r.tokens * self.dp / r.seconds / n_world  # global tokens over all GPUs, per GPU
            rec = step_record(self.step, r.loss, r.grad_norm, r.lr, tok_s, self.flops_tok, self.peak, self.device)
            rec.update(step_time_s=r.seconds, **r.extra)
            rec.update(progress.fields(self.step, r.seconds, self.consumed * cfg.model.seq_length, kept_share))
            if cfg.train.eval_interval and (self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps):
                rec["val_loss"] = self.evaluate()
            history.append(rec)
            log.write(rec)
            if self.step % cfg.logging.log_interval == 0 or self.step == cfg.train.steps:
                log0(format_line(rec))
            si = cfg.checkpoint.save_interval
            saved = (si and self.step % si == 0) or (self.step == cfg.train.steps and cfg.checkpoint.save_at_end)
            if saved:
                with guard.saving(self.step):
                    where = self.save()
                log0(f"saved checkpoint {where}" if where else f"step {self.step}: non-finite state, not saved")
            if self.step < cfg.train.steps:
                guard.boundary(self.step, bool(saved), self.save)  # a signal: save, stop (exit 75)
        self.dp_opt.wait_params()
        log.close()
        return history


def run_training(cfg: Config) -> dict:
    """Train ``cfg`` in this process group and return the per-step history (used by `sparsity decay-search`)."""
    tr = Trainer(cfg, init_groups=not dist.is_initialized())
    history = tr.fit()
    return {
        "losses": [r["loss"] for r in history],
        "flip_rates": [r.get("flip_rate", {}) for r in history],
        "history": history,
    }


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    p = argparse.ArgumentParser(prog="megasparse train", description="Train a model.")
    p.add_argument("config", nargs="?", help="YAML config (configs/*.yaml); omitted: built-in defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 parallel.tp=2")
    a = p.parse_args(argv)
    cfg = a.config
    overrides = list(a.overrides)
    if cfg is not None and "=" in cfg and not cfg.endswith((".yaml", ".yml")):
        overrides.insert(0, cfg)
        cfg = None
    return cfg, overrides


def main(argv: list[str] | None = None) -> int:
    cfg_path, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    # exit 0, 75 (stopped by a signal after saving), 2 (one ConfigError line), 1 (a failed rank, named)
    return runguard.run_main(lambda: load_config(cfg_path, overrides), lambda cfg: Trainer(cfg).fit())


if __name__ == "__main__":
    sys.exit(main())
