"""One micro-batch's forward, selection and backward captured in a CUDA graph and replayed (``train.cuda_graphs``).

Why: at micro-batch 1 the eager step is host-bound. A TinyLlama micro-batch launches ~2,000 kernels (~2,400 with
the compact backward) through Python, autograd and the dispatcher; on an H100 the collider step spent 576 ms of
GPU time inside an 810–910 ms step (decision 0007, when graphs came in; since then about 940 and 1,150 launches a
micro-batch, dense and filtered: ``benchmarks/profile_step.py``). A replayed graph issues them all in one call.
The compact backward is capturable because nothing in it reads device values on the host (docs/decisions/0006)
and its shapes are static.

What is captured, for a single-stage (pp = 1) CUDA run: token ids copied into a static buffer → model forward →
per-token loss summed into a static accumulator → selection → the backward, which accumulates into pre-allocated
``.grad`` tensors. Gradient reduction over DP, the norm, clipping and the optimizer step stay eager. The graph is
captured on the first training step after a few eager warm-up passes on a side stream (they compile kernels and
pick GEMM algorithms; their effects are zeroed), and replayed once per micro-batch of every step.

2:4 sparse FFNs: before each step's replays every sparse GEMM brings its operands up to date in place on the
host (``Sparse24Gemm.prepare_replay``); a mask refresh or the switch to dense fine-tuning changes the buffers the
GEMMs read, and the graph is captured again (every ``sparsity.refresh_interval`` steps).

Where it is not exact or not capturable, ``capture_blocker`` names why, and the trainer runs eagerly and logs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megasparse.data.batch import Batch


def capture_blocker(cfg, pp: int, device: torch.device) -> str | None:
    """Why this run cannot use the captured micro-batch (None: it can)."""
    if not cfg.train.cuda_graphs:
        return "train.cuda_graphs=false"
    if device.type != "cuda":
        return "not on CUDA"
    if pp > 1:
        return "pipeline parallelism (stages exchange activations between micro-batches)"
    f = cfg.filter
    if f.mode != "off" and f.scorer == "random":
        return "filter.scorer=random draws from a generator seeded per micro-batch on the host"
    if f.mode != "off" and f.scorer == "excess" and f.reference != "model":
        return f"filter.reference={f.reference} looks reference losses up on the host"
    if f.mode != "off" and f.scorer == "excess":
        return "filter.reference=model runs a second model per micro-batch"
    if cfg.sparsity.enabled and cfg.sparsity.mvue:
        return "sparsity.mvue draws its random seeds on the host"
    if cfg.loss.vocab_over_pp:
        return "loss.vocab_over_pp"
    if cfg.parallel.distributed_optimizer:
        return "parallel.distributed_optimizer (bf16 gradients reach fp32 buffers through hooks; gathers are waited on)"
    return None


def sparse_gemms(model: torch.nn.Module) -> list:
    """The 2:4 GEMM adapters the converter installed (their operands are refreshed before replays)."""
    from megasparse.sparse24.gemm import Sparse24Gemm

    return [m.gemm for m in model.modules() if isinstance(getattr(m, "gemm", None), Sparse24Gemm)]


class MicrobatchGraph:
    """``run_one(batch)`` captured once, replayed for each micro-batch's tokens.

    ``run_one`` adds the micro-batch's summed per-token loss into ``acc["loss"]`` (in place) and runs its backward;
    the captured graph writes into this object's static accumulator and the parameters' ``.grad``."""

    def __init__(
        self,
        run_one: Callable[[Batch], None],
        example: Batch,
        params: list[torch.nn.Parameter],
        acc: dict,
        warmup: int = 2,
    ):
        self.batch = Batch(example.tokens.clone(), example.samples, example.positions)
        self.loss_acc = torch.zeros((), dtype=torch.float64, device=example.tokens.device)
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:  # the backward must accumulate into tensors that outlive the capture
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        acc["loss"] = self.loss_acc
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run_one(self.batch)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run_one(self.batch)
        # what the warm-up passes accumulated; afterwards the trainer clears the gradient buckets every step
        # (DataParallelOptimizer.zero_grad, before the first micro-batch), so the replays need no zeroing of their own
        torch._foreach_zero_([p.grad for p in self.params])

    def run(self, batches: list[Batch], acc: dict) -> None:
        """One step: clear the loss accumulator, replay once per micro-batch."""
        self.loss_acc.zero_()
        for b in batches:
            self.batch.tokens.copy_(b.tokens, non_blocking=True)
            self.graph.replay()
        acc["loss"] = self.loss_acc

    def release(self) -> None:
        """Give the graph's private memory pool back (a trainer that is dropped while others run)."""
        self.graph.reset()


def _log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class CapturedSteps:
    """The trainer's side of it: capture when the run allows, capture again when the 2:4 operands change, and run
    eagerly (saying why, once) when a capture fails."""

    def __init__(self, cfg, pp: int, device: torch.device, model: torch.nn.Module):
        self.blocker = capture_blocker(cfg, pp, device)
        self.model = model
        self.graph: MicrobatchGraph | None = None
        self.key: tuple = ()
        self.recaptures: list[int] = []
        if device.type == "cuda" and self.blocker is not None:
            _log0(f"cuda graphs off: {self.blocker}")

    @property
    def active(self) -> bool:
        """A captured backward owns its ``.grad`` tensors: zero them in place, never set them to None."""
        return self.graph is not None

    def run(self, batches: list[Batch], run_one: Callable[[Batch], None], acc: dict, step: int) -> bool:
        """Replay the captured micro-batch for each batch (capturing it first); False: run this step eagerly."""
        if self.blocker is not None:
            return False
        key = tuple(g.prepare_replay() for g in sparse_gemms(self.model))  # 2:4 operands updated in place
        if self.graph is not None and key != self.key:  # new masks or dense fine-tuning: capture again
            self.release()
            self.recaptures.append(step)
            if len(self.recaptures) >= 3 and self.recaptures[-1] - self.recaptures[-3] <= 2:
                return self._off("2:4 operands are rebuilt every step (in-place value refresh unverified)")
        self.key = key
        if self.graph is None:
            try:
                self.graph = MicrobatchGraph(run_one, batches[0], list(self.model.parameters()), acc)
            except Exception as e:  # noqa: BLE001 - an uncapturable op: say so once and stay eager
                for p in self.model.parameters():  # the warm-up passes' gradients, in place: DP bucket slices
                    if p.grad is not None:
                        p.grad.zero_()
                acc["loss"] = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
                return self._off(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            _log0(f"cuda graphs: one micro-batch captured, replayed {len(batches)}x per step")
        self.graph.run(batches, acc)
        return True

    def _off(self, why: str) -> bool:
        self.blocker = why
        self.release()
        _log0(f"cuda graphs off: {why}")
        return False

    def release(self) -> None:
        if self.graph is not None:
            self.graph.release()
            self.graph = None
