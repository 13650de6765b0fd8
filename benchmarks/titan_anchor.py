"""torchtitan 0.2.2's own ``Trainer.train_step`` as an anchor of the end-to-end matrix (benchmark code only).

Cases ``torchtitan-bf16`` and ``torchtitan-fp8`` (``CASES``): torchtitan's Llama-3 model built with the config's
shapes, per-block ``torch.compile`` (and the compiled loss), AdamW (fused), grad clip, no activation checkpointing
(megasparse recomputes nothing by default; bench_e2e's ``--titan-ac`` sets it); fp8 is torchao's tensorwise float8
through torchtitan's own ``quantize.linear.float8`` converter with the output layer excluded and, under FSDP,
float8 parameter all-gathers with the scale precomputed after the optimizer step (torchtitan's recommended
tensorwise setting). Layout: FSDP over
every rank (torchtitan's default, ``data_parallel_shard_degree=-1``) with bf16 parameters and fp32 reduction; on one
GPU no FSDP, and torchtitan wraps the step in ``torch.autocast(bf16)`` over fp32 parameters. TP without FSDP is not
offered: 0.2.2 turns mixed precision off there (fp32 compute).

Micro-batch = torchtitan's ``local_batch_size``; it accumulates gradients up to the config's global batch, as
megasparse does. Tokens are synthetic (seeded ``randint`` below the vocabulary), fed to ``train_step`` through its
own iterator protocol: no tokenizer, no dataset, no download. The step is timed like every other case (warm-up
steps, which include compilation, then synchronised steps); the warm-up's wall time is reported (``warmup_s``).

Needs ``pip install .[bench]`` (torchtitan 0.2.2, torchao 0.17.0, torchdata, tyro, ...). torchtitan imports
``datasets`` and ``torch.utils.tensorboard`` at module level; where they are missing, ``install_import_stubs`` puts
inert stand-ins into ``sys.modules`` (the anchor uses neither: no dataset, tensorboard off). See decision 0504.
"""

from __future__ import annotations

import gc
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megasparse.config import Config
from megasparse.model.config import ModelConfig

CASES: dict[str, bool] = {"torchtitan-bf16": False, "torchtitan-fp8": True}  # name -> float8 on
TITAN_VERSION = "0.2.2"
SPEC_NAME = "megasparse_bench_llama3"
FLAVOR = "bench"


def titan_param_count(m: ModelConfig) -> tuple[int, int]:
    """(all parameters, input-embedding parameters) of torchtitan's Llama-3 with the config's shapes (untied)."""
    h, d, v = m.hidden_size, m.head_dim, m.vocab_size
    attn = h * (m.num_attention_heads + 2 * m.kv_heads) * d + m.num_attention_heads * d * h
    per_layer = attn + 3 * h * m.ffn_size + 2 * h  # + the two norms
    return m.num_layers * per_layer + h + 2 * v * h, v * h  # blocks, final norm, embedding, output layer


def titan_flops_per_token(m: ModelConfig) -> float:
    """torchtitan's MFU numerator, from the config: 6·(parameters − input embedding) + 6·L·heads·2·head_dim·seq
    (its peak: 989 TFLOP/s on H100 SXM and H200, as megasparse's).

    Its parameters include the norms and the untied output layer; megasparse's ``flops_per_token`` counts the same
    matrices plus 12·L·h·s, so the two differ by the final norm's 6·h only (and by padded vocabulary rows, which
    torchtitan does not have)."""
    total, emb = titan_param_count(m)
    return 6.0 * (total - emb) + 6.0 * m.num_layers * m.num_attention_heads * 2 * m.head_dim * m.seq_length


def missing_modules() -> list[str]:
    """Which of the modules torchtitan imports at module level without needing them here cannot be imported (a
    module already in ``sys.modules``, a stub included, counts as present)."""
    probes = {"datasets": "datasets", "torch.utils.tensorboard": "tensorboard"}  # module -> what it needs installed
    return [n for n, need in probes.items() if n not in sys.modules and importlib.util.find_spec(need) is None]


def install_import_stubs() -> list[str]:
    """Inert stand-ins for ``datasets`` and ``torch.utils.tensorboard`` where they are not installed (the GPU
    image lacks both); using one raises. Benchmark-only: the anchor builds no dataset and logs no tensorboard."""

    def refuse(name: str) -> Callable:
        def call(*_a, **_k):
            raise RuntimeError(f"titan_anchor: {name} is a stub (decision 0504); the anchor must not use it")

        return call

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() on it answers instead of raising
        return mod

    stubbed = []
    for name in missing_modules():
        if name == "datasets":
            ds = module("datasets")
            ds.Dataset = type("Dataset", (), {"__init__": refuse("datasets.Dataset")})
            ds.IterableDataset = type("IterableDataset", (), {"__init__": refuse("datasets.IterableDataset")})
            ds.load_dataset = refuse("datasets.load_dataset")
            dd = module("datasets.distributed")
            dd.split_dataset_by_node = refuse("datasets.distributed.split_dataset_by_node")
            ds.distributed = dd
            sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dd
        else:
            tb = module("torch.utils.tensorboard")
            tb.SummaryWriter = type("SummaryWriter", (), {"__init__": refuse("torch.utils.tensorboard.SummaryWriter")})
            sys.modules["torch.utils.tensorboard"] = tb
        stubbed.append(name)
    return stubbed


def import_titan():
    """torchtitan's modules this anchor uses, after the stubs; a one-line error naming the fix otherwise."""
    stubbed = install_import_stubs()
    try:
        import torchtitan
        import torchtitan.protocols.train_spec as spec_mod
        from torchtitan.config import JobConfig
        from torchtitan.models import llama3
        from torchtitan.train import Trainer
    except ImportError as e:
        raise RuntimeError(
            f"titan_anchor: cannot import torchtitan ({type(e).__name__}: {e}); install the [bench] extra "
            f"(torchtitan=={TITAN_VERSION}, torchao==0.17.0, ...: ../shared/tools/device-wheels.sh --titan)"
        ) from e
    version = getattr(torchtitan, "__version__", "?")
    if not str(version).startswith(TITAN_VERSION):
        print(f"titan_anchor: warning: torchtitan {version}, built for {TITAN_VERSION}", flush=True)
    return types.SimpleNamespace(
        version=version, stubbed=stubbed, spec_mod=spec_mod, JobConfig=JobConfig, llama3=llama3, Trainer=Trainer
    )


def model_args(tt, m: ModelConfig):
    """torchtitan's Llama-3 model arguments with the config's shapes. Its FFN width is
    ``multiple_of · ceil(int(multiplier · int(8h/3)) / multiple_of)``; ``multiple_of`` = the config's FFN width
    (with a multiplier ≤ 1 that brings int(8h/3) under it) gives exactly that width: 14336 for the 8B shape, as its
    own "8B" flavor (1.3, 1024) does."""
    base = int(2 * 4 * m.hidden_size / 3)
    f = m.ffn_size
    mult = None if base <= f else f / base
    return tt.llama3.TransformerModelArgs(
        dim=m.hidden_size,
        n_layers=m.num_layers,
        n_heads=m.num_attention_heads,
        n_kv_heads=m.kv_heads,
        vocab_size=m.vocab_size,
        multiple_of=f,
        ffn_dim_multiplier=mult,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        max_seq_len=m.seq_length,
    )


def register_spec(tt, args) -> None:
    """torchtitan's llama3 train spec under our name with one flavor (our shapes), no tokenizer, no dataloader (the
    anchor feeds batches itself), no HF state-dict adapter (no checkpoint)."""
    spec = tt.llama3.get_train_spec()
    spec.model_args = {FLAVOR: args}
    spec.build_tokenizer_fn = None
    spec.build_dataloader_fn = None
    spec.build_validator_fn = None
    spec.state_dict_adapter = None
    tt.spec_mod._extra_train_specs[SPEC_NAME] = spec  # replaced per case: register_train_spec refuses a second one


AC_MODES = ("none", "selective", "full")


def job_config(tt, cfg: Config, fp8: bool, dump_folder: str, ac: str = "none", fp8_allgather: bool = True):
    """torchtitan's JobConfig for one case, set field by field (no tyro, no TOML). ``ac``: its activation
    checkpointing (none by default, as megasparse's; torchtitan's own default is selective). ``fp8_allgather``:
    under FSDP, float8 parameter all-gathers with precomputed scales (torchtitan's advice for tensorwise)."""
    if ac not in AC_MODES:
        raise ValueError(f"titan_anchor: activation checkpointing {ac!r}: use one of {AC_MODES}")
    jc = tt.JobConfig()
    m, o, t = cfg.model, cfg.optim, cfg.train
    jc.job.dump_folder = dump_folder
    jc.job.description = f"megasparse bench anchor ({'fp8' if fp8 else 'bf16'})"
    jc.metrics.log_freq = 10**9  # torchtitan's loop logs (and syncs on the loss) at step 1 only: a warm-up step
    jc.metrics.enable_tensorboard = False
    jc.model.name, jc.model.flavor = SPEC_NAME, FLAVOR
    jc.model.converters = ["quantize.linear.float8"] if fp8 else []
    f8 = jc.quantize.linear.float8
    f8.recipe_name = None  # tensorwise; a recipe name would forbid the float8 all-gather below
    f8.enable_fsdp_float8_all_gather = fp8 and fp8_allgather  # the converter keeps it off without FSDP (one GPU)
    f8.precompute_float8_dynamic_scale_for_fsdp = fp8 and fp8_allgather
    f8.filter_fqns = ["output"]
    jc.optimizer.lr, jc.optimizer.eps, jc.optimizer.weight_decay = o.lr, 1e-8, o.weight_decay
    jc.optimizer.beta1, jc.optimizer.beta2 = o.beta1, o.beta2
    jc.lr_scheduler.warmup_steps = o.warmup_steps
    jc.training.local_batch_size = t.micro_batch_size
    jc.training.global_batch_size = t.global_batch_size
    jc.training.seq_len = m.seq_length
    jc.training.steps = 10**6
    jc.training.max_norm = o.grad_clip
    jc.training.dtype = "float32"  # master weights; FSDP's param_dtype (or autocast on one GPU) computes in bf16
    jc.training.mixed_precision_param = "bfloat16"
    jc.training.mixed_precision_reduce = "float32"
    jc.parallelism.data_parallel_shard_degree = -1  # FSDP over every rank
    jc.parallelism.tensor_parallel_degree = 1
    jc.parallelism.pipeline_parallel_degree = 1
    jc.activation_checkpoint.mode = ac
    jc.compile.enable = True
    jc.compile.components = ["model", "loss"]
    jc.checkpoint.enable = False
    jc.debug.seed = t.seed
    return jc


def synthetic_batches(batch: int, seq: int, vocab: int, seed: int) -> Iterator[tuple[dict, torch.Tensor]]:
    """torchtitan's batch protocol, (``{"input": [b, s]}``, labels ``[b, s]``) on the CPU, from seeded tokens."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield {"input": x[:, :-1].contiguous()}, x[:, 1:].contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_state_gib(optimizers) -> float:
    """fp32 parameters and AdamW moments this rank holds (FSDP shards: their local parts)."""
    total = 0
    for opt in getattr(optimizers, "optimizers", [optimizers]):
        for group in opt.param_groups:
            for p in group["params"]:
                for t in [p, *(v for v in opt.state.get(p, {}).values() if torch.is_tensor(v))]:
                    loc = _local(t)
                    if loc.dtype == torch.float32 and loc.numel() > 1:
                        total += loc.numel() * loc.element_size()
    return total / 2**30


class TitanCase:
    """One torchtitan Trainer built for a case; ``step()`` runs its own ``train_step`` once, synchronised."""

    def __init__(self, cfg: Config, fp8: bool, dump_folder: str, ac: str = "none", fp8_allgather: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError("titan_anchor: torchtitan's Trainer needs CUDA")
        if cfg.model.vocab_size is None:
            raise RuntimeError("titan_anchor: model.vocab_size must be set (synthetic tokens below it)")
        os.environ.setdefault("LOCAL_RANK", "0")  # torchtitan picks its device from it (torchrun sets it)
        tt = import_titan()
        self.version, self.stubbed = tt.version, tt.stubbed
        args = model_args(tt, cfg.model)
        register_spec(tt, args)
        torch._dynamo.reset()  # no compiled graph (nor its shapes marked dynamic) carries over from another case
        self.trainer = None
        try:
            self.trainer = tt.Trainer(job_config(tt, cfg, fp8, dump_folder, ac, fp8_allgather))
            self.check_shapes(cfg.model)
        except BaseException:
            self.close()
            raise
        tr = self.trainer
        self.flops_per_token = float(tr.metrics_processor.num_flops_per_token)
        self.fsdp = tr.parallel_dims.fsdp_enabled
        self.grad_accum = tr.gradient_accumulation_steps
        dp = tr.parallel_dims.dp_shard if tr.parallel_dims.dp_enabled else 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.data = tr.batch_generator(
            synthetic_batches(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size, 1000 + rank)
        )
        self.loss_scale = dp  # a rank's summed micro-batch losses are its tokens' loss sum / all ranks' tokens
        self.losses: list[torch.Tensor] = []
        inner = tr.forward_backward_step

        def forward_backward_step(**kw):
            loss = inner(**kw)
            self.losses.append(loss.detach())
            return loss

        tr.forward_backward_step = forward_backward_step  # what train_step returns nothing of: the loss, kept here

    def check_shapes(self, m: ModelConfig) -> None:
        """The built model has the config's FFN width and parameter count (global shapes under FSDP)."""
        params = dict(self.trainer.model_parts[0].named_parameters())
        w1 = [p for n, p in params.items() if n.endswith("feed_forward.w1.weight")]
        n = sum(p.numel() for p in params.values())
        want = titan_param_count(m)[0]
        if not w1 or w1[0].shape[0] != m.ffn_size or n != want:
            got = w1[0].shape[0] if w1 else None
            raise RuntimeError(
                f"titan_anchor: torchtitan built FFN {got} and {n} parameters, want {m.ffn_size}, {want}"
            )

    def step(self) -> tuple[float | None, float]:
        """(None, seconds): one ``train_step`` as torchtitan's loop runs it (step counter, GC cadence)."""
        tr = self.trainer
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tr.step += 1
        tr.gc_handler.run(tr.step)
        tr.train_step(self.data)
        torch.cuda.synchronize()
        return None, time.perf_counter() - t0

    def mean_losses(self) -> list[float]:
        """Per step, this rank's share of the mean token loss times dp (≈ the mean loss: ranks see equal tokens)."""
        if not self.losses:
            return []
        per_step = torch.stack(self.losses).view(-1, self.grad_accum).sum(1) * self.loss_scale
        self.losses.clear()
        return [float(x) for x in per_step.tolist()]

    def close(self) -> None:
        """Drop the trainer and what it holds; torchtitan turned automatic GC off (``GarbageCollection``), also when
        its constructor failed half-way."""
        tr, self.trainer = self.trainer, None
        try:
            if tr is not None:
                tr.close()
        finally:
            del tr
            gc.enable()
            gc.collect()
            torch._dynamo.reset()
            torch.cuda.empty_cache()


def run_case(
    cfg: Config,
    name: str,
    warmup: int,
    steps: int,
    after=None,
    ac: str = "none",
    fp8_allgather: bool = True,
    dump_folder: str | None = None,
) -> dict:
    """bench_trainer.run_case's result for a torchtitan case, plus ``warmup_s`` (build and compile included),
    ``titan_flops_per_token`` (torchtitan's own count) and the layout it ran. ``warmup`` is at least 2: the first
    step compiles."""
    import bench_trainer as bt

    bt._free()
    dev = torch.device("cuda", torch.cuda.current_device())
    leftover = torch.cuda.memory_allocated(dev) / 2**30
    folder = dump_folder or os.path.join(os.environ.get("TMPDIR", "/tmp"), "titan_anchor")
    Path(folder).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    case = TitanCase(cfg, CASES[name], folder, ac, fp8_allgather)
    try:
        warm_ms = [1e3 * case.step()[1] for _ in range(max(2, warmup))]
        warmup_s = time.perf_counter() - t0
        bt._reset_peak(dev)
        times = [case.step()[1] for _ in range(steps)]
        mem = bt._peak_gib(dev) - leftover
        optim_gib = optimizer_state_gib(case.trainer.optimizers)
        extra = after(case.step) if after is not None else None
        losses = case.mean_losses()
        info = {
            "titan_flops_per_token": case.flops_per_token,
            "titan_layout": f"FSDP over {case.trainer.parallel_dims.dp_shard}" if case.fsdp else "1 GPU, autocast",
            "titan_grad_accum": case.grad_accum,
            "titan_ac": ac,
            "titan_fp8_allgather": CASES[name] and fp8_allgather and case.fsdp,
            "titan_version": case.version,
            "titan_stubbed": case.stubbed,
        }
    finally:
        case.close()
        del case
    bt._free()
    return {
        "times": times,
        "mem_gib": mem,
        "graph_pool_gib": 0.0,
        "optim_state_gib": optim_gib,
        "leftover_gib": leftover,
        "losses": losses,
        "after": extra,
        "warmup_s": warmup_s,
        "warmup_ms": warm_ms,
        **info,
    }
