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

Pipeline stages (pp > 1, plain 1F1B: ``StageGraphs``): the P2P transfers stay eager between graphs; each in-flight
slot of the stage (1F1B holds at most pp − rank micro-batches between forward and backward) gets a forward graph
(static input → stage output) and a backward graph (static output gradient, dense or compact indices + rows → the
caught input gradient and the ``.grad`` accumulation), both in the slot's own memory pool. The last stage runs its
forward and backward back to back, so it is one graph. The first step runs eagerly (the warm-up: kernels
compiled, the loss speed check, GEMM algorithms picked); the second captures every slot before its schedule starts
and every later step replays them (docs/decisions/0007, addendum).

2:4 sparse FFNs: before each step's replays every sparse GEMM brings its operands up to date in place on the
host (``Sparse24Gemm.prepare_replay``); a mask refresh or the switch to dense fine-tuning changes the buffers the
GEMMs read, and the graph is captured again (every ``sparsity.refresh_interval`` steps).

Where it is not exact or not capturable, ``capture_blocker`` names why, and the trainer runs eagerly and logs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megasparse.data.batch import Batch
from megasparse.ops.compact import CompactGrad
from megasparse.parallel import comm, state
from megasparse.parallel.pipeline import StageComm, catch_grad, in_flight_slots


def capture_blocker(cfg, pp: int, device: torch.device) -> str | None:
    """Why this run cannot use the captured micro-batch (None: it can)."""
    if not cfg.train.cuda_graphs:
        return "train.cuda_graphs=false"
    if device.type != "cuda":
        return "not on CUDA"
    if pp > 1 and cfg.parallel.virtual_stages > 1:
        return "parallel.virtual_stages > 1 (the interleaved schedule's chunks run eagerly)"
    if cfg.filter.mode == "collider":
        seq_count, shards = _static_counts(cfg)
        if seq_count is None and cfg.train.micro_batch_size > 1:
            return (
                f"filter.granularity={cfg.filter.granularity} at micro_batch_size > 1 (the compact attention backward "
                "reads each sequence's kept count on the host; granularity=balanced or sequence fixes it)"
            )
        if shards != cfg.parallel.sp_shards:
            return (
                f"filter.granularity={cfg.filter.granularity} under SP (each SP rank's kept count is read from the "
                "indices on the host; granularity=balanced fixes it)"
            )
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


def _static_counts(cfg) -> tuple[int | None, int]:
    """(kept rows per sequence, SP shards balanced) that the selection fixes by shape (``selection.static_counts``)."""
    from megasparse.filtering.selection import static_counts

    f = cfg.filter
    shape = (cfg.model.seq_length, cfg.train.micro_batch_size)
    return static_counts(shape, f.keep_ratio, f.granularity, cfg.parallel.sp_shards)


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


@dataclass
class _Slot:
    """One in-flight micro-batch position of a pipeline stage: its static buffers and graphs."""

    batch: Batch
    """Static tokens (the first stage embeds the ids, the last reads the targets)."""
    x: torch.Tensor | None
    """Static stage input (None on the first stage)."""
    pool: tuple
    """The slot's graph memory pool (its forward and backward graphs share it)."""
    caught: dict = field(default_factory=dict)
    """The stage input's gradient, left by the backward replay (a static tensor or CompactGrad)."""
    out: torch.Tensor | None = None
    """Static stage output sent downstream (None on the last stage)."""
    grad: torch.Tensor | None = None
    """Static dense output gradient (None on the last stage and when it is compact)."""
    idx: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    """Static compact output gradient: global kept indices and this rank's rows."""
    fwd: torch.cuda.CUDAGraph | None = None
    bwd: torch.cuda.CUDAGraph | None = None
    """The last stage's one graph is ``fwd`` (forward, loss, selection and backward); ``bwd`` stays None."""


class StageGraphs:
    """A pipeline stage's 1F1B micro-batches as replayed CUDA graphs, one forward and one backward graph per
    in-flight slot, each slot in its own memory pool.

    Why per slot: up to pp − rank micro-batches are between forward and backward at once, each with its own saved
    activations; a graph's activations live at fixed addresses, so each in-flight micro-batch needs its own. Micro-
    batch i uses slot i mod slots: 1F1B starts i + slots only after i's backward (``pipeline.in_flight_slots``).
    Why a pool per slot: a pool shared by graphs is safe only if they replay in capture order, and a slot's forward
    replays again before the other slots' backwards. Received tensors are copied into the static buffers (one
    activation-sized copy per micro-batch); what a graph leaves for sending is static and read before that slot's
    next replay on the same stream.

    The object is also the schedule's in-flight handler (``pipeline.one_f_one_b(..., in_flight=)``): ``forward`` and
    ``backward`` take the received tensors and return what to send, like ``pipeline._InFlight``."""

    def __init__(
        self,
        p2p: StageComm,
        forward_step: Callable,
        backward_step: Callable,
        example: Batch,
        acc: dict,
        num_mb: int,
    ):
        lay = state.layout()
        self.first, self.last = lay.is_first_stage, lay.is_last_stage
        self.loss_acc = torch.zeros((), dtype=torch.float64, device=example.tokens.device)
        acc["loss"] = self.loss_acc  # the last stage's forward adds each micro-batch's loss sum into it in place
        self.batches: list[Batch] = []
        self.slots: list[_Slot] = []
        spec = p2p.spec
        try:
            for _ in range(1 if self.last else in_flight_slots(num_mb)):
                x = None
                if not self.first:
                    x = torch.zeros(spec.act_shape, dtype=spec.dtype, device=spec.device).requires_grad_()
                tokens = Batch(example.tokens.clone(), example.samples, example.positions)
                slot = _Slot(tokens, x, torch.cuda.graph_pool_handle())
                self.slots.append(slot)
                self._capture(slot, p2p, forward_step, backward_step)
        except Exception:
            self.release()
            raise

    def _capture(self, s: _Slot, p2p: StageComm, forward_step: Callable, backward_step: Callable) -> None:
        s.fwd = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread polls the eager P2P transfers' events while a stage captures
        with torch.cuda.graph(s.fwd, pool=s.pool, capture_error_mode="thread_local"):
            x = None if s.x is None else catch_grad(s.x, s.caught)
            out = forward_step(0, x, 0, s.batch)
            if self.last:
                with comm.phase("backward"):
                    backward_step(0, out, None)
        if self.last:
            return
        s.out = out.detach()
        spec = p2p.spec
        if spec.kept_rows is None:
            s.grad = torch.zeros(spec.act_shape, dtype=spec.dtype, device=spec.device)
        else:  # any valid indices do for the capture: it reads none of them on the host
            s.idx = torch.arange(spec.kept_rows(), device=spec.device)
            s.rows = torch.zeros(p2p.static_rows(), spec.act_shape[-1], dtype=spec.dtype, device=spec.device)
        s.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.bwd, pool=s.pool, capture_error_mode="thread_local"), comm.phase("backward"):
            g = s.grad if s.idx is None else p2p.compact_grad(s.idx, s.rows)
            backward_step(0, out, g)

    # -- one step ------------------------------------------------------------------------------------------------
    def start(self, batches: list[Batch], acc: dict) -> StageGraphs:
        """Begin a step over ``batches``: the loss accumulator cleared and handed to ``acc``."""
        self.batches = batches
        self.loss_acc.zero_()
        acc["loss"] = self.loss_acc
        return self

    def _slot(self, mb: int) -> _Slot:
        return self.slots[mb % len(self.slots)]

    def forward(self, key, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch ``mb``'s inputs into its slot, then its forward (the last stage's waits for ``backward``)."""
        s = self._slot(mb)
        if self.first or self.last:  # the ids to embed, the targets of the loss
            s.batch.tokens.copy_(self.batches[mb].tokens, non_blocking=True)
        if s.x is not None:
            s.x.detach().copy_(x)
        if self.last:
            return None
        s.fwd.replay()
        return s.out

    def backward(self, key, mb: int, g: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch ``mb``'s output gradient into its slot, its backward; the input gradient to send upstream."""
        s = self._slot(mb)
        if self.last:
            s.fwd.replay()
        else:
            if isinstance(g, CompactGrad):
                s.idx.copy_(g.meta.global_meta().idx)
                s.rows.copy_(g.rows)
            else:
                s.grad.copy_(g)
            s.bwd.replay()
        return s.caught.get("grad")

    def release(self) -> None:
        for s in self.slots:
            for graph in (s.fwd, s.bwd):
                if graph is not None:
                    graph.reset()
        self.slots = []


def _every_step(steps: list[int]) -> bool:
    """Whether the last three of these steps fall within three consecutive steps (2:4 operands that keep moving)."""
    return len(steps) >= 3 and steps[-1] - steps[-3] <= 2


def _root_cause(e: BaseException) -> str:
    """The first error of a failed capture: ending the capture raises its own error, which hides the cause (a host
    synchronisation, an allocation the capture forbids) in its context."""
    for _ in range(8):
        if e.__cause__ is None and e.__context__ is None:
            break
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def _log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class CapturedSteps:
    """The trainer's side of it: capture when the run allows, capture again when the 2:4 operands change, and run
    eagerly (saying why, once) when a capture fails. pp = 1 replays one captured micro-batch (``run``); pp > 1
    replays a stage's per-slot graphs inside the 1F1B schedule (``stage``)."""

    def __init__(self, cfg, pp: int, device: torch.device, model: torch.nn.Module):
        self.blocker = capture_blocker(cfg, pp, device)
        self.model = model
        self.graph: MicrobatchGraph | None = None
        self.stage_graphs: StageGraphs | None = None
        self.warm = False
        """pp > 1: whether an eager step ran since the last capture (or operand change): it is the warm-up."""
        self.key: tuple = ()
        self.recaptures: list[int] = []
        """pp = 1: steps whose operand move released a captured graph."""
        self.moves: list[int] = []
        """pp > 1: steps whose 2:4 operands moved (each costs an eager step and a capture)."""
        if device.type == "cuda" and self.blocker is not None:
            _log0(f"cuda graphs off: {self.blocker}")

    @property
    def active(self) -> bool:
        """A captured backward owns its ``.grad`` tensors: zero them in place, never set them to None."""
        return self.graph is not None or self.stage_graphs is not None

    def _new_operands(self, step: int) -> bool:
        """Bring the 2:4 operands up to date in place; True when they moved to new buffers (graphs that read the old
        ones are released: new masks, the autotune's switch, dense fine-tuning)."""
        key = tuple(g.prepare_replay() for g in sparse_gemms(self.model))  # 2:4 operands updated in place
        moved = key != self.key
        if moved and self.active:
            self.release()
            self.recaptures.append(step)
        self.key = key
        return moved

    def run(self, batches: list[Batch], run_one: Callable[[Batch], None], acc: dict, step: int) -> bool:
        """Replay the captured micro-batch for each batch (capturing it first); False: run this step eagerly."""
        if self.blocker is not None:
            return False
        if self._new_operands(step) and _every_step(self.recaptures):
            return self._off("2:4 operands are rebuilt every step (in-place value refresh unverified)")
        if self.graph is None:
            try:
                self.graph = MicrobatchGraph(run_one, batches[0], list(self.model.parameters()), acc)
            except Exception as e:  # noqa: BLE001 - an uncapturable op: say so once and stay eager
                for p in self.model.parameters():  # the warm-up passes' gradients, in place: DP bucket slices
                    if p.grad is not None:
                        p.grad.zero_()
                acc["loss"] = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
                return self._off(f"capture failed ({_root_cause(e)})")
            _log0(f"cuda graphs: one micro-batch captured, replayed {len(batches)}x per step")
        self.graph.run(batches, acc)
        return True

    def stage(
        self,
        batches: list[Batch],
        p2p: StageComm,
        forward_step: Callable,
        backward_step: Callable,
        acc: dict,
        step: int,
    ) -> StageGraphs | None:
        """pp > 1: this step's in-flight handler for ``one_f_one_b`` (captured before the schedule when needed), or
        None: run this step eagerly (blocked, the warm-up step before a capture, or a failed capture).

        Every operand move costs one eager step with the new operands (the warm-up) and a capture on the next: a
        stage whose operands move on three steps in a row would never replay, so it stops trying."""
        if self.blocker is not None:
            return None
        first = not self.key  # the first key (or none: no 2:4 GEMMs) is no move
        if self._new_operands(step) and not first:
            self.warm = False
            self.moves.append(step)
            if _every_step(self.moves):
                self._off("2:4 operands are rebuilt every step (in-place value refresh unverified)")
                return None
        if self.stage_graphs is None:
            if not self.warm:  # the eager step compiles kernels, times the loss and picks GEMM algorithms
                self.warm = True
                return None
            try:
                self.stage_graphs = StageGraphs(p2p, forward_step, backward_step, batches[0], acc, len(batches))
            except Exception as e:  # noqa: BLE001 - an uncapturable op: say so once and stay eager
                acc["loss"] = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
                self._off(f"capture failed ({_root_cause(e)})")
                return None
            n = len(self.stage_graphs.slots)
            what = "one graph (forward + backward)" if self.stage_graphs.last else f"{n} forward + {n} backward graphs"
            _log0(f"cuda graphs: pipeline stage captured as {what}, replayed inside 1F1B")
        return self.stage_graphs.start(batches, acc)

    def _off(self, why: str) -> bool:
        """Stay eager from now on. Said on every rank it happens on: stages and TP ranks may differ (a rank that
        replays and one that runs eagerly issue the same transfers and collectives, so they still meet)."""
        self.blocker = why
        self.release()
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""
        print(f"{rank}cuda graphs off: {why}", flush=True)
        return False

    def release(self) -> None:
        if self.graph is not None:
            self.graph.release()
            self.graph = None
        if self.stage_graphs is not None:
            self.stage_graphs.release()
            self.stage_graphs = None
