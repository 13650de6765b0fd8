"""The trainer: ``megasparse train CONFIG.yaml [section.key=value ...]`` (also under torchrun / Slurm).

Order of business: load and validate the whole config against the world size (before any process group exists),
build the data, create the groups, build this rank's pipeline stage and its components, then run steps: the
step's micro-batches (``megasparse/step/``: one micro-batch's forward, loss and backward, ordered by the config's
schedule, run eagerly or as replayed CUDA graphs), gradients reduced over DP in buckets that overlap the backward
(and the SP-replicated norms over TP), clip, AdamW (replicated or sharded over DP) with warmup + cosine, log,
evaluate and checkpoint.

Features plug in rather than being wired here: the model comes from ``model/builder.py``, token filtering is a
``filtering/component.py`` TokenFilter fed by ``data/batch.py`` Batches, 2:4 sparsity a
``sparse24/converter.py`` converter with optimizer hooks, the vocabulary over PP a ``loss/pipeline.py``
VocabOverPP, gradient buckets, norm and the (distributed) optimizer in ``parallel/ddp.py`` and
``parallel/dist_optim.py`` (docs/decisions/0403, 0404, 0013).
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
from megasparse.banner import format_banner
from megasparse.chunkflow.step import chunk_step
from megasparse.config import Config, dump_config, load_config
from megasparse.cudagraph import CapturedSteps
from megasparse.data.batch import Batch
from megasparse.data.dataset import build_data, iterate_batches
from megasparse.guard import NonFiniteGuard
from megasparse.metrics import MetricsLog, Progress, flops_per_token, format_line, peak_tflops, step_record
from megasparse.model.builder import build_model, resolve_device, resolve_dtype
from megasparse.optim import build_data_parallel, lr_at
from megasparse.parallel import state
from megasparse.parallel.state import log0
from megasparse.step.build import build_components, init_weights, run_facts, stage_comm
from megasparse.step.executor import ForwardBackward, global_mean

__all__ = ["StepResult", "Trainer", "main", "run_training"]


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
        self.dp = cfg.validate(state.world_env()[1])
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
        self.model = build_model(cfg, self.vocab, device=self.device, compute_dtype=self.compute_dtype)
        init_weights(cfg, self.model, self.vocab)  # checkpoint.init_from: before buckets and 2:4 masks read them
        # the components (filter, 2:4, fp8, vocabulary over PP): each brings its hooks and why graphs can't run
        dev, dt, last = self.device, self.compute_dtype, self.lay.is_last_stage
        parts = self.parts = build_components(cfg, self.model, self.train_ds, self.vocab, dev, dt, last)
        self.filter, self.sparsity, self.vocab_pp = parts.filter, parts.sparsity, parts.vocab_pp
        self.graphs = CapturedSteps(cfg, self.lay.pp, dev, self.model, parts.for_capture())  # train.cuda_graphs
        # gradient buckets over DP and AdamW on them (sharded under parallel.distributed_optimizer): before the 2:4
        # converter, so its masks and operands see the parameters in their final dtype and storage
        self.dp_opt = build_data_parallel(self.model, cfg, dev, dt, eager=self.graphs.blocker is not None)
        self.optimizer = self.dp_opt.optimizer
        self.fp8 = parts.convert(cfg, self.model, dev)  # 2:4 FFNs, then train.fp8's GEMMs (on W ⊙ M where 2:4)
        self.dp_opt.keep_compute_copies()  # bf16 weights cast once per optimizer step, not per micro-batch
        self.num_mb = cfg.num_microbatches(self.dp)
        self.p2p = stage_comm(cfg, self.filter, dev, dt)
        # one step: what runs per micro-batch x the schedule x the executor (megasparse/step/, decision 0013)
        self.forward_backward = ForwardBackward.build(
            cfg, self.model, parts, self.p2p, self.graphs, self.num_mb, self.dp, self.lay.dp_rank, dev
        )
        self.chunkflow = chunk_step(cfg, self.model, self.vocab, self.dp, self.lay.dp_rank, dev, self.p2p, self.filter)
        self.step = self.consumed = 0
        self.guard = NonFiniteGuard(cfg.train.max_skipped_steps)  # reliability: skip non-finite steps
        self.flops_tok = flops_per_token(cfg.model, self.vocab_padded)
        self.peak = peak_tflops(self.device)
        self.out_dir = Path(cfg.logging.out_dir)

    def _microbatches(self, ds, start: int, count: int) -> list[Batch]:
        it = iterate_batches(ds, self.cfg.train.micro_batch_size, self.lay.dp_rank, self.dp, start)
        return [next(it).to(self.device, pin=self.device.type == "cuda") for _ in range(count)]

    # -- one optimizer step ---------------------------------------------------------------------
    def compute_gradients(self) -> tuple[torch.Tensor, int]:
        """Forward + backward of this step's global batch; leaves fully reduced gradients in the DP buckets."""
        cf = self.chunkflow  # chunkflow.enabled: this rank's chunks of the step's whole sequences, a backward each
        batches = cf.batches(self.step) if cf else self._microbatches(self.train_ds, self.consumed, self.num_mb)
        self.dp_opt.zero_grad(len(batches))
        loss_sum, tokens = (cf or self.forward_backward)(batches, True, self.step)
        self.dp_opt.reduce()
        return loss_sum, tokens

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        lr = lr_at(self.cfg, self.step)
        for g in self.dp_opt.param_groups:
            g["lr"] = lr
        loss_sum, tokens = self.compute_gradients()
        gnorm = self.dp_opt.grad_norm()
        loss = global_mean(loss_sum, tokens, self.lay.is_last_stage, self.device)
        # reliability: a non-finite step is skipped before clipping/decay/optimizer.step touch any state
        if self.guard.check(self.step + 1, loss, gnorm, log0):
            self.dp_opt.zero_grad()
            self.step += 1
            self.consumed += self.cfg.train.global_batch_size
            return StepResult(loss, gnorm, lr, tokens, time.perf_counter() - t0, {"skipped": self.guard.total})
        self.dp_opt.clip(gnorm, self.cfg.optim.grad_clip)
        self.parts.pre_optimizer_step(self.dp_opt.optimizer)
        self.dp_opt.step(wait=self.parts.reads_weights_after_step)  # 2:4 / fp8 hooks read whole weights
        extra = self.parts.post_optimizer_step(self.step + 1)  # masks refreshed, fp8 copies remade
        extra.update(self.chunkflow.last if self.chunkflow else {})  # real tokens and chunk fill of the step
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        return StepResult(loss, gnorm, lr, tokens, time.perf_counter() - t0, extra)

    @torch.no_grad()
    def evaluate(self) -> float:
        batches = self._microbatches(self.valid_ds, 0, self.cfg.train.eval_batches * self.num_mb)
        loss_sum, tokens = self.forward_backward(batches, False, self.step)
        return global_mean(loss_sum, tokens, self.lay.is_last_stage, self.device)

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
        facts = run_facts(self)
        n_world, kept = facts.world, facts.kept_rows
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
            seen = r.extra.get("tokens_seen", self.consumed * cfg.model.seq_length)  # chunkflow: real ones
            rec.update(progress.fields(self.step, r.seconds, seen, kept_share))
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
