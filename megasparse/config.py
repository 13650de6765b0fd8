"""The run config: one dataclass per section, loaded from YAML plus dotted overrides.

    cfg = load_config("configs/cpu_toy.yaml", ["train.steps=20", "parallel.tp=2"])
    cfg.validate(world_size=4)      # before any process group exists

Each section lives next to the code it configures; this file only composes them and holds
the trainer's own sections (train, optim, checkpoint, logging).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from megasparse.chunkflow.config import ChunkFlowConfig
from megasparse.configbase import ConfigError, apply_override, from_dict, to_dict
from megasparse.data.config import DataConfig
from megasparse.filtering.config import FilterConfig
from megasparse.loss.config import LossConfig
from megasparse.model.config import ModelConfig
from megasparse.parallel.config import AUTO, ParallelConfig
from megasparse.sparse24.config import SparsityConfig

__all__ = ["Config", "ConfigError", "load_config", "to_dict"]


@dataclass
class TrainConfig:
    """Steps, batch sizes, precision and evaluation cadence."""

    steps: int = 100
    micro_batch_size: int = 2
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all DP ranks; accumulation = global / (micro · dp)."""
    seed: int = 1234
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """auto (bf16 on GPU, fp32 on CPU), bf16 or fp32. bf16 keeps fp32 master weights and grads."""
    eval_interval: int = 50
    """Evaluate on the validation split every this many steps (0 turns it off)."""
    eval_batches: int = 4
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda if available), cuda or cpu."""
    deterministic: bool = False
    cuda_graphs: bool = True
    """Replay CUDA graphs instead of launching each kernel from Python: one micro-batch's forward, selection and
    backward at pp = 1; each pipeline stage's forward and backward per 1F1B slot at pp > 1 (after one eager warm-up
    step). CUDA runs whose step reads nothing on the host; megasparse/cudagraph.py says which stay eager and why."""
    max_skipped_steps: int = 10
    """Stop (exit 2) after this many consecutive steps with a non-finite loss or gradient norm; each is skipped."""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """fp8 GEMMs for qkv, proj, fc1 and fc2 (megasparse/fp8/, decision 1000): e4m3 activations and weights, e5m2
    gradients, scales from each operand's current amax (one per tensor, or per row along each GEMM's reduction).
    The output layer and the loss stay bf16; 2:4 fc1/fc2 run fp8 GEMMs on their masked weights W ⊙ M (decision
    1001). Needs sm_89+ on CUDA; on CPU it runs an exact emulation (for tests)."""
    fp8_wgrad: bool = True
    """The weight gradient's GEMM in fp8 too (e5m2 gradient × e4m3 input), as torchao's float8 does; false keeps it
    in bf16, straight into the fp32 bucket. On four H200s fp8 took 4% off the whole Llama-3-8B's fp8 step at PP 2 ×
    DP 2 and 5% off TP 2 + SP at mb 2, and the 300-step accuracy study stayed within 1% of bf16 (decision 1234). It
    may cost memory (fp8's peak on that 8B's PP 2 × DP 2 ranks read 62.5 GiB with bf16, 70.2 with fp8; collider + fp8
    70 either way): false where a run no longer fits."""
    fp8_keep_transpose: bool = True
    """Keep each fp8 weight's e4m3 transpose (the input gradient's operand) from one optimizer step to the next: one
    byte per block parameter. false (tensorwise only) transposes the e4m3 weight at each backward instead: a byte
    per parameter read and written per micro-batch, ~1% of an 8B step, for a byte per parameter less memory (3.3 GiB
    on a whole-8B PP 2 stage): the lever that fits fp8 at seq 8192 on 80 GB cards (decision 1245)."""
    fp8_min_mnk: float = 4.0e10
    """On CUDA a linear runs fp8 only when rows · out · in of its smallest GEMM (the backward's kept rows under
    collider) reaches this: below it the casts cost more than the fp8 GEMM saves (H100 measurements, decision
    1001); 0: every linear."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 turns it off)."""


@dataclass
class CheckpointConfig:
    """Sharded torch.distributed.checkpoint saves; atomic via tmp-dir + rename."""

    save_interval: int = 0
    """Save every this many steps (0: only at the end if ``save_at_end``)."""
    save_at_end: bool = True
    resume: str | None = None
    """Directory to resume from: a run's out_dir (latest step) or one step-N directory; ``auto``: the latest
    valid checkpoint of logging.out_dir, else a fresh start (one command for the first launch and restarts)."""
    keep_last: int = 2
    signal: str | None = "SIGUSR1"
    """A signal that, like SIGTERM and SIGINT, saves a checkpoint at the next step boundary and stops (exit 75):
    what Slurm's ``--signal`` sends before the time limit (launch/slurm/train.sbatch); none: only TERM/INT."""
    accept_changes: bool = False
    """Resume even when the data order or optimisation settings differ from the checkpoint's (data.*, filter.*,
    optim.*, model.seq_length, train.global_batch_size, train.seed); off: such a resume is refused in one line."""
    init_from: str | None = None
    """Start at step 0 (fresh optimizer and data order) from these weights: a Hugging Face model directory
    (Llama, Qwen2; see ``megasparse hf import``) or a megasparse checkpoint, at any tp/pp/dp layout."""


@dataclass
class LoggingConfig:
    """Console lines and metrics.jsonl."""

    out_dir: str = "runs/default"
    log_interval: int = 1
    tensorboard: bool = False
    """Also write the metrics with TensorBoard's SummaryWriter (<out_dir>/tensorboard; needs the package)."""
    wandb_project: str | None = None
    """Also log the metrics to this Weights & Biases project (needs the wandb package)."""
    previous_run: Literal["refuse", "move_aside"] = "refuse"
    """A fresh run (no checkpoint.resume) into an out_dir holding another run's checkpoints or metrics: refuse
    (one line), or move them into ``<out_dir>/previous-<time>/`` (nothing is deleted)."""


@dataclass
class Config:
    """A whole run: model, layout, data, training and the three accelerations."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    chunkflow: ChunkFlowConfig = field(default_factory=ChunkFlowConfig)

    def validate(self, world_size: int, devices: bool = True) -> int:
        """Check everything that can be checked without a process group; return the DP size. ``devices=False``
        skips what depends on this machine (CUDA present, the output directory writable): `megasparse plan` is
        arithmetic about a run on other machines."""
        m, p, t = self.model, self.parallel, self.train
        m.validate()
        dp = p.validate(world_size, m.num_layers, m.seq_length)
        if m.num_attention_heads % p.tp:
            raise ConfigError(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={p.tp}"
            )
        if m.kv_heads % p.tp:
            raise ConfigError(
                f"model.num_query_groups={m.kv_heads} is not divisible by parallel.tp={p.tp}; "
                "each TP rank needs whole KV heads"
            )
        if m.ffn_size % p.tp:
            raise ConfigError(f"model.ffn_hidden_size={m.ffn_size} is not divisible by parallel.tp={p.tp}")
        if m.vocab_size is not None and m.vocab_size <= 0:
            raise ConfigError(f"model.vocab_size={m.vocab_size} must be positive (or null: tokenizer's)")
        if t.steps < 1 or t.micro_batch_size < 1:
            raise ConfigError("train.steps and train.micro_batch_size must be >= 1")
        if t.global_batch_size % (t.micro_batch_size * dp) and not self.chunkflow.enabled:  # chunkflow deals tokens
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} x dp={dp}; pick a multiple of "
                f"{t.micro_batch_size * dp}"
            )
        if self.optim.warmup_steps < 0 or self.optim.lr <= 0:
            raise ConfigError("optim.lr must be > 0 and optim.warmup_steps >= 0")
        self._validate_operations(devices)
        self.data.validate()
        self.loss.validate()
        self.filter.validate()
        self.sparsity.validate()
        self.chunkflow.validate(self, dp)
        if self.filter.mode != "off" and self.filter.granularity == "shard" and not p.sequence_parallel:
            raise ConfigError("filter.granularity=shard needs parallel.sequence_parallel=true")
        if self.loss.impl == "mcore" and self.filter.mode == "collider":
            raise ConfigError(
                "loss.impl=mcore has a dense backward, so filter.mode=collider cannot compact it; "
                "use loss.impl=cce or materialized, or filter.mode=loss_mask"
            )
        untied_only = p.distributed_optimizer or p.virtual_stages > 1 or self.loss.vocab_over_pp
        if m.tie_embeddings and p.pp > 1 and untied_only:
            raise ConfigError(
                "model.tie_embeddings=true under parallel.pp > 1 sums the two stages' copies' gradients over an "
                "embedding group, implemented without parallel.distributed_optimizer, parallel.virtual_stages or "
                "loss.vocab_over_pp; turn those off or use parallel.pp=1"
            )
        if p.layer_split == AUTO and self.chunkflow.enabled:
            raise ConfigError(
                "parallel.layer_split=auto: the planner does not model chunkflow's chunks (a varying count per step, "
                "each with its K/V state); give parallel.layer_split as a list or null"
            )
        if self.loss.vocab_over_pp and p.pp == 1:
            raise ConfigError("loss.vocab_over_pp=true needs parallel.pp > 1")
        if p.virtual_stages > 1 and self.loss.vocab_over_pp:
            raise ConfigError(
                "loss.vocab_over_pp=true runs a lock-step schedule, not interleaved 1F1B; "
                "set parallel.virtual_stages=1 or loss.vocab_over_pp=false"
            )
        if p.virtual_stages > 1 and self.num_microbatches(dp) % p.pp:
            raise ConfigError(
                f"parallel.virtual_stages={p.virtual_stages}: {self.num_microbatches(dp)} micro-batches per step "
                f"(train.global_batch_size / (micro_batch_size x dp)) must be a multiple of parallel.pp={p.pp}"
            )
        split = self.loss.embedding_pp_split
        if split is not None and (len(split) != p.pp or min(split) < 0 or abs(sum(split) - 1.0) > 1e-6):
            raise ConfigError(
                f"loss.embedding_pp_split={split}: give parallel.pp={p.pp} non-negative fractions summing to 1, "
                "or null to let the planner balance memory"
            )
        return dp

    def _validate_operations(self, devices: bool = True) -> None:
        """Values that used to crash mid-run (ZeroDivisionError, val NaN) or be silently accepted."""
        t, o, lg = self.train, self.optim, self.logging
        for name, v in (("grad_clip", o.grad_clip), ("weight_decay", o.weight_decay), ("min_lr", o.min_lr)):
            if v < 0:
                raise ConfigError(f"optim.{name}={v} must be >= 0")
        if lg.log_interval < 1:
            raise ConfigError(f"logging.log_interval={lg.log_interval} must be >= 1 (print every N steps)")
        if t.eval_interval < 0 or (t.eval_interval and t.eval_batches < 1):
            raise ConfigError(
                f"train.eval_batches={t.eval_batches} must be >= 1 while train.eval_interval={t.eval_interval} "
                "(set train.eval_interval=0 to turn evaluation off)"
            )
        if t.max_skipped_steps < 1:
            raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1")
        if not t.fp8_keep_transpose and t.fp8 == "rowwise":
            raise ConfigError(
                "train.fp8_keep_transpose=false needs train.fp8=tensorwise (rowwise scales Wᵀ per column: its "
                "transpose is a second cast, not a copy); set train.fp8=tensorwise or train.fp8_keep_transpose=true"
            )
        if self.checkpoint.keep_last < 0 or self.checkpoint.save_interval < 0:
            raise ConfigError("checkpoint.keep_last and checkpoint.save_interval must be >= 0")
        if not devices:
            return
        import torch

        if not torch.cuda.is_available():
            if t.device == "cuda":
                raise ConfigError("train.device=cuda but CUDA is not available here; use train.device=cpu or auto")
            if self.parallel.backend == "nccl":
                raise ConfigError("parallel.backend=nccl needs CUDA, which is not available here; use gloo or auto")
        if t.fp8 != "off" and t.device != "cpu" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            if cap < (8, 9):
                raise ConfigError(
                    f"train.fp8={t.fp8} needs fp8 GEMMs (sm_89+: Ada, Hopper); this GPU is sm_{cap[0]}{cap[1]}: "
                    "set train.fp8=off"
                )
        if t.device == "cpu" and self.parallel.backend == "nccl":
            raise ConfigError("parallel.backend=nccl cannot carry train.device=cpu tensors; use gloo or auto")
        writable_dir(lg.out_dir, "logging.out_dir")
        from megasparse.preempt import signal_number

        signal_number(self.checkpoint.signal)

    def dist_backend(self) -> str:
        """``parallel.backend`` with auto resolved for this run: gloo whenever ``train.device=cpu`` (NCCL cannot carry
        CPU tensors, and a GPU host would otherwise pick it), else NCCL where CUDA is available."""
        if self.parallel.backend == "auto" and self.train.device == "cpu":
            return "gloo"
        return self.parallel.backend

    def num_microbatches(self, dp: int) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    def padded_vocab(self, vocab: int) -> int:
        """Vocabulary padded so every TP (and, with vocab_over_pp, PP) shard has equal size."""
        shards = self.parallel.tp * (self.parallel.pp if self.loss.vocab_over_pp else 1)
        mult = self.model.make_vocab_divisible_by * shards
        return int(math.ceil(vocab / mult) * mult)

    def to_dict(self) -> dict:
        return to_dict(self)


def writable_dir(path: str | os.PathLike, what: str) -> None:
    """ConfigError unless ``path`` exists as a writable directory or can be created (checked, not created)."""
    p = Path(path).absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what}={path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}={path} is not writable ({probe} denies write access)")


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or defaults when ``path`` is None) and apply ``key.sub=value`` overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file '{path}' does not exist; see configs/ for examples")
        if p.is_dir():
            raise ConfigError(f"config file '{path}' is a directory; give a YAML file (see configs/)")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}); give a YAML file") from e
        except OSError as e:
            raise ConfigError(f"config file '{path}' cannot be read: {e.strerror or e}") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from e
        if data is None:  # an empty file is almost always a mistake (wrong path, truncated copy)
            raise ConfigError(
                f"config file '{path}' is empty; give at least one section, or omit the file to train the defaults"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    for ov in overrides:
        apply_override(data, Config, ov)
    return from_dict(Config, data)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
