"""2:4 sparsity as a model converter (in the spirit of torchtitan's model converters).

    conv = Sparse24Converter(cfg.sparsity, total_steps, compute_dtype)
    conv.convert(model)                 # the model names its FFN GEMMs (``model.ffn_linears``); they go 2:4
    ... backward ...
    conv.pre_optimizer_step(optimizer)  # masked decay into the gradients (or, fused: the sparse weights' whole step)
    optimizer.step()
    metrics.update(conv.post_optimizer_step(step))   # refresh / flip rate / dense switch
    extra.update(conv.extra_state())    # masks travel in the checkpoint's extra state

The trainer calls these hooks and knows nothing else about sparsity; the recipe itself lives in
:class:`~megasparse.sparse24.recipe.SparsityManager`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megasparse.parallel.shards import shard_like
from megasparse.sparse24.config import SparsityConfig
from megasparse.sparse24.gemm import Sparse24Gemm
from megasparse.sparse24.optim import FusedMaskedAdamW
from megasparse.sparse24.recipe import SparsityManager

__all__ = ["Sparse24Converter"]

_MASK = "mask."


class Sparse24Converter:
    """Makes a model's FFN linears 2:4 sparse; each TP shard keeps its own transposable masks."""

    def __init__(self, cfg: SparsityConfig, total_steps: int, compute_dtype: torch.dtype) -> None:
        self.cfg, self.total_steps, self.compute_dtype = cfg, int(total_steps), compute_dtype
        self.manager: SparsityManager | None = None
        self.autotune: GemmAutotune | None = None
        self.fused: FusedMaskedAdamW | None = None
        self.gemms: list[Sparse24Gemm] = []
        """The 2:4 GEMM adapters installed by ``convert`` (their operands are refreshed before graph replays)."""

    def capture_blocker(self) -> str | None:
        """Why a CUDA graph cannot capture the 2:4 GEMMs (None: it can); ``cudagraph`` asks."""
        return "sparsity.mvue draws its random seeds on the host" if self.cfg.mvue else None

    def prepare_replay(self) -> tuple:
        """Bring every 2:4 GEMM's operands up to date in place before replays; the key of the buffers they read
        (a new key: new masks, the autotune's switch or dense fine-tuning moved them, and graphs are captured again)."""
        return tuple(g.prepare_replay() for g in self.gemms)

    def convert(self, model: torch.nn.Module) -> SparsityManager:
        """Convert the FFN linears the model names (``model.ffn_linears(layers)``) in ``sparsity.layers``."""
        wanted = None if self.cfg.layers == "all" else {int(x) for x in self.cfg.layers.split(",")}
        return self.convert_linears(model.ffn_linears(wanted))

    def convert_linears(self, linears: dict[str, torch.nn.Module]) -> SparsityManager:
        """Install a Sparse24Gemm on each linear (weight name → layer with ``.weight`` and a pluggable ``.gemm``)."""
        self.manager = SparsityManager({n: lin.weight for n, lin in linears.items()}, self.cfg, self.total_steps)
        gemms = []
        for n, lin in linears.items():
            lin.gemm = Sparse24Gemm(self.manager, n, lin.weight, self.compute_dtype, self.cfg.mvue)
            gemms.append(lin.gemm)
        self.gemms = gemms
        on_gpu = any(lin.weight.is_cuda for lin in linears.values())
        if (on_gpu or FusedMaskedAdamW.reference_off_gpu) and not self.cfg.monitor_only:
            self.fused = FusedMaskedAdamW(self.manager, {n: lin.gemm for n, lin in linears.items()})
        if self.cfg.backend == "auto" and on_gpu and self.total_steps >= GemmAutotune.STEPS_NEEDED:
            self.autotune = GemmAutotune(gemms)
        return self.manager

    def pre_optimizer_step(self, optimizer=None) -> None:
        """Masked decay of the pruned weights, added to the gradients the optimizer is about to use; with a fused
        CUDA AdamW, the sparse weights' whole step instead (decay, AdamW and their bf16 copy in one kernel,
        ``optim.py``), and the optimizer's own step skips them. The distributed optimizer lends its pieces of them
        to the same kernel (decision 1237); where that does not apply (CPU, amsgrad), it names the part of each
        gradient it steps with ``owned_range``, and only that is decayed (decision 1236). Whichever path runs
        claims the step's decay from the manager, which refuses a second claim."""
        if optimizer is not None and self.fused is not None and self.fused.step(optimizer):
            return
        self.manager.apply_masked_decay(getattr(optimizer, "owned_range", None))

    def post_optimizer_step(self, step: int) -> dict:
        """After optimizer step ``step`` (1-based): refresh masks on schedule; metrics for the step's log line."""
        out: dict = {}
        if self.fused is not None:
            self.fused.restore()
        mgr = self.manager
        if mgr.sparse and mgr.cfg.decay != 0.0 and not mgr.decayed:
            raise RuntimeError("sparsity: optimizer step without the masked decay (call pre_optimizer_step first)")
        if self.autotune is not None:
            self.autotune.tick(step)
        rates = self.manager.after_step(step)
        if rates:
            out["flip_rate"] = rates
        out["sparse"] = self.manager.sparse
        return out

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Masks (and the dense switch) as checkpoint extra-state tensors; a mask shards like its weight, so a
        checkpoint resumes with its masks at another TP/PP layout (``n`` is a global name: global layer ids)."""
        w = self.manager.weights
        extra = {_MASK + n: shard_like(m.to(torch.uint8), w[n]) for n, m in self.manager.masks.items()}
        extra["sparsity_dense"] = torch.tensor(int(self.manager.dense))
        return extra

    def load_extra_state(self, extra: dict[str, torch.Tensor], step: int) -> None:
        """Restore masks and the dense switch saved by :meth:`extra_state` at optimizer step ``step``."""
        masks = {k[len(_MASK) :]: v.bool() for k, v in extra.items() if k.startswith(_MASK)}
        if self.fused is not None:
            self.fused.reset()  # the optimizer state (and its step counts) was just loaded
        self.manager.load_state_dict({"step": step, "dense": bool(extra["sparsity_dense"]), "masks": masks})


class GemmAutotune:
    """``sparsity.backend=auto``: keep cuSPARSELt GEMMs only if the whole step is faster with them.

    Per-GEMM timings (``linear.decide``) miss what a step pays around them (operand refreshes, layouts, the
    cache); a user switching 2:4 on must never get a slower step. The first training steps are timed with the
    sparse GEMMs, the next with masked dense GEMMs (the same arithmetic: X·(W⊙M)ᵀ), and the faster stays. The
    clock is read at each post-optimizer hook, so the interval between two hooks is one whole step; the trainer's
    own end-of-step synchronisation makes it a device time. The masks, decay and refresh schedule are unchanged.
    """

    STEPS_NEEDED = 8
    _PLAN = (("warm", True), ("time", True), ("time", True), ("warm", False), ("time", False), ("time", False))

    def __init__(self, gemms: list, clock=time.perf_counter) -> None:
        self.gemms, self.clock = gemms, clock
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.last: float | None = None
        self.i = 0
        self.choice: bool | None = None

    def _set(self, sparse: bool) -> None:
        for g in self.gemms:
            g.use_sparse = sparse

    def tick(self, step: int) -> None:
        now = self.clock()
        if self.choice is not None:
            return
        if self.last is None:  # only layers running 2:4 GEMMs have a choice (fp8 may run them all: decision 1235)
            self.gemms = [g for g in self.gemms if g.tunable]
            if not self.gemms:
                self.choice = False  # nothing to time (fp8's banner line says so, or the run starts dense)
                return
        if self.last is not None and self.i < len(self._PLAN):
            kind, sparse = self._PLAN[self.i]
            if kind == "time":
                self.times[sparse].append(now - self.last)
            self.i += 1
        self.last = now
        if self.i < len(self._PLAN):
            self._set(self._PLAN[self.i][1])
            return
        t_sparse, t_dense = min(self.times[True]), min(self.times[False])
        self.choice = t_sparse <= t_dense
        self._set(self.choice)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"sparsity: step with cuSPARSELt GEMMs {1e3 * t_sparse:.1f} ms, with masked dense GEMMs "
                f"{1e3 * t_dense:.1f} ms: keeping {'cuSPARSELt' if self.choice else 'dense'} GEMMs",
                flush=True,
            )
