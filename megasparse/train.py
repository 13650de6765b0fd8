"""The trainer: ``megasparse train CONFIG.yaml [section.key=value ...]`` (also under torchrun / Slurm).

Order of business: load and validate the whole config against the world size (before any process
group exists), build the data, create the groups, build this rank's pipeline stage, then run
steps of 1F1B over micro-batches, reduce gradients over DP (and the SP-replicated norms over TP),
clip, step AdamW with warmup + cosine, log, evaluate and checkpoint.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megasparse import checkpoint as ckpt
from megasparse.config import Config, ConfigError, dump_config, load_config
from megasparse.guard import NonFiniteGuard
from megasparse.metrics import MetricsLog, flops_per_token, format_line, peak_mem_gib, peak_tflops
from megasparse.model.gpt import GPTStage
from megasparse.ops.compact import KeepHolder, KeepMeta
from megasparse.parallel import comm, state, vocab_pp
from megasparse.parallel.pipeline import P2PSpec, StageComm, catch_grad, lockstep, one_f_one_b


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


# --------------------------------------------------------------------------------------------- data
class SyntheticData:
    """Seeded random tokens (``data.prefix: synthetic``) for tests and benchmarks that need no corpus."""

    def __init__(self, vocab: int, seq: int, seed: int, n: int = 4096):
        self.vocab, self.seq, self.seed, self.n = vocab, seq, seed, n

    def __len__(self) -> int:
        return self.n

    def global_sample(self, g: int, seed: int | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + g)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=gen)


def _iterate(ds, micro: int, dp_rank: int, dp: int, start: int):
    g = start + dp_rank * micro
    while True:
        yield torch.stack([ds.global_sample(g + j) for j in range(micro)])
        g += micro * dp


def build_data(cfg: Config):
    """(train, valid, vocab_size) — vocab from the tokenizer unless model.vocab_size is set."""
    if cfg.data.prefix == "synthetic":
        if cfg.model.vocab_size is None:
            raise ConfigError("data.prefix=synthetic needs model.vocab_size")
        v = cfg.model.vocab_size
        return (
            SyntheticData(v, cfg.model.seq_length, cfg.data.seed),
            SyntheticData(v, cfg.model.seq_length, cfg.data.seed + 1, n=256),
            v,
        )
    from megasparse.data.dataset import build_datasets

    train, valid, info = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    return train, valid, cfg.model.vocab_size or info.vocab_size


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
            state.init(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel, cfg.parallel.backend)
        self.lay = state.layout()
        dev = cfg.train.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
        dt = cfg.train.dtype
        if dt == "auto":
            dt = "bf16" if self.device.type == "cuda" else "fp32"
        self.compute_dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.vocab_padded = cfg.padded_vocab(self.vocab)
        m = cfg.model
        self.model = GPTStage(
            m,
            cfg.parallel.stage_layers(m.num_layers),
            self.vocab,
            self.vocab_padded,
            seed=cfg.train.seed,
            device=self.device,
            compute_dtype=self.compute_dtype,
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss=cfg.loss,
            embedding_rows=self._embedding_rows(),
        )
        self.sparsity = self._build_sparsity() if cfg.sparsity.enabled else None
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            foreach=self.device.type == "cuda",
        )
        self.num_mb = cfg.num_microbatches(self.dp)
        s_local = m.seq_length // (self.lay.tp if cfg.parallel.sequence_parallel else 1)
        self.act_shape = (s_local, cfg.train.micro_batch_size, m.hidden_size)
        f = cfg.filter
        self.collider = f.mode == "collider"
        self.sp_size = self.lay.tp if cfg.parallel.sequence_parallel else 1
        self.kept_rows = self._kept_rows() if f.mode != "off" else 0
        self.reference = self._build_reference() if f.mode != "off" and f.scorer == "excess" else None
        kept = (lambda: self.kept_rows) if self.collider else None
        spec = P2PSpec(self.act_shape, self.compute_dtype, self.device, kept, cfg.train.micro_batch_size)
        self.vocab_peer = None  # loss.vocab_over_pp on a non-last stage: its slice of every micro-batch's loss
        if self.model.vocab_pp and not self.lay.is_last_stage:
            self.vocab_peer = vocab_pp.VocabPPPeer(
                self.model.output_weight,
                cfg.loss,
                vocab_start=self.model.vocab_start,
                vocab_size=self.vocab,
                rows=m.seq_length * cfg.train.micro_batch_size,
                compute_dtype=self.compute_dtype,
                kept_rows=self.kept_rows if self.collider else None,
            )
        self.p2p = StageComm(spec)
        self.step = 0
        self.consumed = 0
        self.guard = NonFiniteGuard(cfg.train.max_skipped_steps)  # reliability: skip non-finite steps
        self.flops_tok = flops_per_token(m, self.vocab_padded)
        self.peak = peak_tflops(self.device)
        self.out_dir = Path(cfg.logging.out_dir)

    def _embedding_rows(self) -> list[int] | None:
        """Input-embedding rows per stage under vocab_over_pp: the planner's memory-balancing split (or the
        configured loss.embedding_pp_split), in whole TP-divisible vocabulary blocks."""
        cfg = self.cfg
        if not (cfg.loss.vocab_over_pp and cfg.loss.embedding_over_pp and self.lay.pp > 1):
            return None
        from megasparse.parallel import planner

        split = cfg.parallel.stage_layers(cfg.model.num_layers)
        shares = planner.embedding_shares(cfg, split, self.vocab, self.lay.dp)
        unit = cfg.model.make_vocab_divisible_by * self.lay.tp
        return vocab_pp.stage_rows(self.vocab_padded, shares, unit)

    # -- 2:4 sparse FFNs ----------------------------------------------------------------------------
    def _build_sparsity(self):
        """A SparsityManager over this rank's FFN shards; each shard keeps its own transposable masks."""
        from megasparse.sparse24.gemm import Sparse24Gemm
        from megasparse.sparse24.recipe import SparsityManager

        sc = self.cfg.sparsity
        wanted = None if sc.layers == "all" else {int(x) for x in sc.layers.split(",")}
        linears = {}
        for block in self.model.layers:
            if wanted is None or block.layer in wanted:
                for lin in (block.mlp.fc1, block.mlp.fc2):
                    linears[lin.pname + ".weight"] = lin
        manager = SparsityManager({n: lin.weight for n, lin in linears.items()}, sc, self.cfg.train.steps)
        for n, lin in linears.items():
            lin.gemm = Sparse24Gemm(manager, n, lin.weight, self.compute_dtype, sc.mvue)
        return manager

    # -- token filtering ---------------------------------------------------------------------------
    def _kept_rows(self) -> int:
        """Kept tokens per micro-batch: static, so compact P2P buffers are sized ahead (no shape exchange)."""
        from megasparse.filtering.selection import kept_count

        s, b, f = self.cfg.model.seq_length, self.cfg.train.micro_batch_size, self.cfg.filter
        if f.granularity == "sequence":
            return b * kept_count(s, f.keep_ratio)
        if f.granularity == "shard":
            return self.sp_size * kept_count(s // self.sp_size * b, f.keep_ratio)
        return kept_count(s * b, f.keep_ratio)

    def _build_reference(self):
        if not self.lay.is_last_stage:
            return None
        f = self.cfg.filter
        if f.reference == "model":
            return self._reference_model()
        from megasparse.filtering.reference import ReferenceLosses

        prefix = getattr(self.train_ds, "prefix", None)
        return ReferenceLosses.from_config(f, self.cfg.data.ref_losses, prefix)

    def _reference_model(self):
        """Same-architecture reference model run online (slowest source; for comparison with n-gram/sidecar)."""
        f, m = self.cfg.filter, self.cfg.model
        if self.lay.pp > 1:
            raise ConfigError("filter.reference=model needs parallel.pp=1 (the reference runs on one stage)")
        if not f.ref_checkpoint:
            raise ConfigError("filter.reference=model needs filter.ref_checkpoint (a run's out_dir or step dir)")
        ref = GPTStage(
            m,
            [m.num_layers],
            self.vocab,
            self.vocab_padded,
            seed=self.cfg.train.seed,
            device=self.device,
            compute_dtype=self.compute_dtype,
            sequence_parallel=self.cfg.parallel.sequence_parallel,
            loss=self.cfg.loss,
        )
        ckpt.load_weights(f.ref_checkpoint, ref)
        ref.requires_grad_(False)

        @torch.no_grad()
        def losses(ids: torch.Tensor, labels: torch.Tensor, _positions=None) -> torch.Tensor:
            ids, labels = ids.to(self.device), labels.to(self.device)
            return ref(ids.contiguous(), labels.reshape(-1), KeepHolder()).view(labels.shape)

        return losses

    def _select(self, per_tok: torch.Tensor, tok: torch.Tensor, mb_index: int):
        """Selection on the last stage: identical on every TP rank (same losses, deterministic ties)."""
        from megasparse.filtering.selection import score_tokens, select_tokens

        f = self.cfg.filter
        s, b = tok.shape[1] - 1, tok.shape[0]
        loss2d = per_tok.detach().view(s, b)
        ref = gen = None
        if f.scorer == "excess":
            ids, labels = tok[:, :-1].t(), tok[:, 1:].t()
            on_host = self.cfg.filter.reference != "model"
            ref = self.reference(ids.cpu() if on_host else ids, labels.cpu() if on_host else labels, None)
        elif f.scorer == "random":
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.cfg.train.seed * 1_000_003 + self.step * 10_007 + mb_index)
        scores = score_tokens(f.scorer, loss2d, ref, generator=gen)
        return select_tokens(scores, f.keep_ratio, f.granularity, sp_size=self.sp_size)

    # -- batches ---------------------------------------------------------------------------------
    def _microbatches(self, ds, start: int, count: int) -> list[torch.Tensor]:
        it = _iterate(ds, self.cfg.train.micro_batch_size, self.lay.dp_rank, self.dp, start)
        return [next(it).to(self.device) for _ in range(count)]

    # -- one optimizer step ---------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        o, total = self.cfg.optim, self.cfg.train.steps
        if o.warmup_steps and step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))

    def _forward_backward(self, batches: list[torch.Tensor], train: bool) -> tuple[float, int]:
        """Run the pipeline over ``batches``; returns (sum of per-token losses on this rank, tokens)."""
        tokens_per_mb = self.cfg.train.micro_batch_size * self.cfg.model.seq_length
        filtering = train and self.cfg.filter.mode != "off"
        per_mb = self.kept_rows if filtering else tokens_per_mb
        normaliser = per_mb * self.num_mb * self.dp  # kept (or all) tokens of the global batch
        acc = {"loss": torch.zeros((), dtype=torch.float64, device=self.device)}

        emb_pp = self.model.embedding if self.model.embedding_pp else None
        inputs = None  # embedding_over_pp: the first stage's inputs of every micro-batch, looked up at once
        caught: list[dict] = [{} for _ in batches]  # the first stage's input gradients under embedding_over_pp
        if emb_pp is not None:
            inputs = emb_pp.lookup_all([tok[:, :-1].t() for tok in batches], requires_grad=train)
            if inputs is not None and train:
                inputs = [catch_grad(x, c) for x, c in zip(inputs, caught)]

        def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            tok = batches[i]
            ids = tok[:, :-1].t().contiguous() if inputs is None else inputs[i]
            targets = tok[:, 1:].t().reshape(-1)
            keep = KeepHolder()
            out = self.model(ids if self.lay.is_first_stage else x, targets, keep)
            if not self.lay.is_last_stage:
                return out
            acc["loss"] += out.detach().double().sum()
            if not filtering:
                return out.sum() / normaliser
            sel = self._select(out, tok, self.lay.dp_rank + i * self.dp)
            if self.collider:
                keep.meta = KeepMeta(sel.idx, out.numel(), tok.shape[0])
            return (out * sel.loss_mask.reshape(-1)).sum() / normaliser

        def backward_step(i: int, out: torch.Tensor, g: torch.Tensor | None) -> None:
            if g is None:
                out.backward()
            else:
                torch.autograd.backward(out, g)

        if train and self.model.vocab_pp:  # the output layer's slices meet once per micro-batch: lock step
            peer = self.vocab_peer
            slot = None if peer is None else lambda k: peer.step(batches[k][:, 1:].t().reshape(-1), train=True)
            lockstep(len(batches), self.p2p, forward_step, backward_step, slot)
            if emb_pp is not None:
                emb_pp.backward_all(None if inputs is None else [c.get("grad") for c in caught])
        elif train:
            one_f_one_b(len(batches), self.p2p, forward_step, backward_step)
        else:
            with torch.no_grad():
                for i in range(len(batches)):
                    x = self.p2p.recv_forward()
                    y = forward_step(i, x)
                    if not self.lay.is_last_stage:
                        self.p2p.send_forward(y)
                    if self.vocab_peer is not None:
                        self.vocab_peer.step(batches[i][:, 1:].t().reshape(-1), train=False)
        return acc["loss"], tokens_per_mb * len(batches)

    def _global_mean(self, loss_sum: torch.Tensor, tokens: int) -> float:
        """Mean loss over every DP rank's tokens, known on every rank (sent from the last stage)."""
        t = torch.stack([loss_sum.double(), torch.tensor(float(tokens), dtype=torch.float64, device=self.device)])
        if not self.lay.is_last_stage:
            t.zero_()
        with comm.phase("metrics"):
            comm.all_reduce(t, None, "world", region="metrics.loss")
        return (t[0] / t[1]).item()

    def _reduce_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        with comm.phase("optim"):
            if self.cfg.parallel.sequence_parallel and self.lay.tp > 1:
                sp = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
                if sp:
                    flat = torch.cat([g.reshape(-1) for g in sp])
                    comm.all_reduce(flat, state.tp_group(), "tp", region="grads.sp_norms")
                    for g, v in zip(sp, torch._utils._unflatten_dense_tensors(flat, sp)):
                        g.copy_(v)
            if self.dp > 1:
                grads = [p.grad for p in params]
                flat = torch._utils._flatten_dense_tensors(grads)
                comm.all_reduce(flat, state.dp_group(), "dp", region="grads.dp")
                for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(v)

    def _grad_norm(self) -> float:
        """Global L2 norm: TP shards summed over the model-parallel group, TP-replicated params counted once."""
        grads = [
            p.grad
            for name, p in self.model.named_parameters()
            if p.grad is not None and (self.model.param_is_sharded(name) or self.lay.tp_rank == 0)
        ]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        with comm.phase("optim"):
            comm.all_reduce(sq, state.mp_group(), "mp", region="grads.norm")
        return math.sqrt(sq.item())

    def compute_gradients(self) -> tuple[torch.Tensor, int]:
        """Forward + backward of this step's global batch; leaves fully reduced gradients in ``.grad``."""
        self.optimizer.zero_grad(set_to_none=True)
        batches = self._microbatches(self.train_ds, self.consumed, self.num_mb)
        loss_sum, tokens = self._forward_backward(batches, train=True)
        self._reduce_grads()
        return loss_sum, tokens

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        lr = self.lr_at(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss_sum, tokens = self.compute_gradients()
        gnorm = self._grad_norm()
        loss = self._global_mean(loss_sum, tokens)
        # reliability: a non-finite step is skipped before clipping/decay/optimizer.step touch any state
        if self.guard.check(self.step + 1, loss, gnorm, log0):
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.consumed += self.cfg.train.global_batch_size
            return StepResult(loss, gnorm, lr, tokens, time.perf_counter() - t0, {"skipped": self.guard.total})
        clip = self.cfg.optim.grad_clip
        if clip > 0 and gnorm > clip:
            torch._foreach_mul_([p.grad for p in self.model.parameters() if p.grad is not None], clip / (gnorm + 1e-6))
        if self.sparsity is not None:
            self.sparsity.apply_masked_decay()
        self.optimizer.step()
        extra = {}
        if self.sparsity is not None:
            rates = self.sparsity.after_step(self.step + 1)
            if rates:
                extra["flip_rate"] = rates
            extra["sparse"] = self.sparsity.sparse
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
            extra.update({f"mask.{n}": m.to(torch.uint8) for n, m in self.sparsity.masks.items()})
            extra["sparsity_dense"] = torch.tensor(int(self.sparsity.dense))
        return extra

    def save(self) -> Path | None:
        return ckpt.save(
            self.out_dir / "checkpoints",
            self.step,
            self.model,
            self.optimizer,
            self._extra(),
            self.cfg.checkpoint.keep_last,
        )

    def resume(self, path: str) -> None:
        where = ckpt.resolve_resume(path)
        extra = ckpt.load(where, self.model, self.optimizer, self._extra())
        self.step, self.consumed = int(extra["step"]), int(extra["consumed"])
        if self.sparsity is not None:
            masks = {k[len("mask.") :]: v.bool() for k, v in extra.items() if k.startswith("mask.")}
            self.sparsity.load_state_dict({"step": self.step, "dense": bool(extra["sparsity_dense"]), "masks": masks})
        log0(f"resumed from {where} at step {self.step}")

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg = self.cfg
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        resume = ckpt.resume_target(cfg.checkpoint.resume, self.out_dir, log0)  # reliability: resume=auto
        if resume:
            self.resume(resume)
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
        log0(
            f"megasparse: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, vocab {self.vocab} "
            f"(padded {self.vocab_padded}) | world {n_world} = tp {self.lay.tp} x pp {self.lay.pp} x dp {self.dp}"
            f"{' +SP' if cfg.parallel.sequence_parallel else ''} | {self.num_mb} micro-batches/step | "
            f"{self.device.type} {str(self.compute_dtype).replace('torch.', '')}"
        )
        history = []
        while self.step < cfg.train.steps:
            r = self.train_step()
            tok_s = r.tokens * self.dp / r.seconds / n_world  # global tokens over all GPUs, per GPU
            tflops = tok_s * self.flops_tok / 1e12
            rec = {
                "step": self.step,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "lr": r.lr,
                "tokens_per_s": tok_s,
                "tflops_per_gpu": tflops,
                "mfu": tflops / self.peak if self.peak else None,
                "mem_gib": peak_mem_gib(self.device),
                "step_time_s": r.seconds,
            }
            rec.update(r.extra)
            if cfg.train.eval_interval and (self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps):
                rec["val_loss"] = self.evaluate()
            history.append(rec)
            log.write(rec)
            if self.step % cfg.logging.log_interval == 0 or self.step == cfg.train.steps:
                log0(format_line(rec))
            si = cfg.checkpoint.save_interval
            if (si and self.step % si == 0) or (self.step == cfg.train.steps and cfg.checkpoint.save_at_end):
                where = self.save()
                log0(
                    f"saved checkpoint {where}"
                    if where
                    else f"step {self.step}: non-finite state, checkpoint not saved"
                )
        log.close()
        return history


class InferenceModel(torch.nn.Module):
    """A single-stage model that scores token streams (``megasparse ref score``)."""

    def __init__(self, stage: GPTStage):
        super().__init__()
        self.stage = stage

    @torch.no_grad()
    def token_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [s, b] -> [s, b]: out[t] is the loss of tokens[t] given tokens[:t]; out[0] = 0."""
        targets = torch.cat([tokens[1:], torch.full_like(tokens[:1], -100)])
        per_tok = self.stage(tokens.contiguous(), targets.reshape(-1), KeepHolder()).view(tokens.shape)
        return torch.cat([torch.zeros_like(per_tok[:1]), per_tok[:-1]])


def load_model_for_inference(cfg: Config, ckpt_dir: str) -> InferenceModel:
    """Build a one-process model (tp = pp = 1) and load a checkpoint saved with that layout."""
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.parallel.sequence_parallel = False
    cfg.parallel.layer_split = None
    cfg.filter.mode = "off"
    tr = Trainer(cfg, init_groups=not dist.is_initialized())
    ckpt.load_weights(ckpt_dir, tr.model)
    tr.model.eval()
    return InferenceModel(tr.model)


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
    try:
        cfg = load_config(cfg_path, overrides)
        trainer = Trainer(cfg)
        trainer.fit()
    except ConfigError as e:  # one line, once (rank 0), exit 2 without a traceback for torchrun to bury it under
        if state.world_env()[0] == 0:
            print(f"megasparse: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
