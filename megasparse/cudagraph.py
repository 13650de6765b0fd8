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

This module is the step's CUDA-graph executor (``step/executor.py`` composes it): the schedule runs each micro-batch
through the handler ``CapturedSteps.in_flight`` returns. It knows no feature: where a run is not exact or not
capturable, ``capture_blocker`` asks the components it is given (each says why itself) and the trainer runs eagerly
and logs the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megasparse.data.batch import Batch
from megasparse.ops.compact import CompactGrad
from megasparse.parallel import comm, state
from megasparse.parallel.pipeline import StageComm, catch_grad, in_flight_slots

# ``step`` below is a ``step.microbatch.MicrobatchStep``: forward(i, x, chunk, batch), backward(i, out, grad) and the
# step's loss accumulator ``loss_sum``, which a captured graph re-points at its own static tensor


def capture_blocker(cfg, pp: int, device: torch.device, components: Iterable = ()) -> str | None:
    """Why this run cannot use captured micro-batches (None: it can).

    This module knows only what the capture itself needs (CUDA, the flag, a schedule it replays inside); every
    feature says for itself why it cannot be captured: each of ``components`` (the token filter, the 2:4 converter,
    the vocabulary over PP, the distributed optimizer; None where off) is asked ``capture_blocker()`` in order."""
    if not cfg.train.cuda_graphs:
        return "train.cuda_graphs=false"
    if device.type != "cuda":
        return "not on CUDA"
    if pp > 1 and cfg.parallel.virtual_stages > 1:
        return "parallel.virtual_stages > 1 (the interleaved schedule's chunks run eagerly)"
    for c in components:
        why = None if c is None else c.capture_blocker()
        if why is not None:
            return why
    return None


def replay_key(components: Iterable) -> tuple:
    """Bring the components' graph operands up to date in place (``prepare_replay``: the 2:4 GEMMs); the key of the
    buffers they read, which changes when they move to new ones."""
    return tuple(k for c in components if c is not None and hasattr(c, "prepare_replay") for k in c.prepare_replay())


class MicrobatchGraph:
    """One micro-batch's forward + loss + backward (``step``) captured once, replayed for each micro-batch's tokens.

    The forward adds the micro-batch's summed per-token loss into ``step.loss_sum`` (in place) and the backward
    accumulates into the parameters' ``.grad``; captured, they write this object's static accumulator and the same
    ``.grad`` tensors. It is also the 1F1B schedule's in-flight handler at pp = 1: ``forward`` copies the tokens into
    the static buffer, ``backward`` replays the graph (one replay per micro-batch, in order)."""

    def __init__(self, step, example: Batch, params: list[torch.nn.Parameter], warmup: int = 2):
        self.batch = Batch(example.tokens.clone(), example.samples, example.positions)
        self.loss_acc = torch.zeros((), dtype=torch.float64, device=example.tokens.device)
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:  # the backward must accumulate into tensors that outlive the capture
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.batches: list[Batch] = []
        step.loss_sum = self.loss_acc

        def run_one(b: Batch) -> None:
            step.backward(0, step.forward(0, None, 0, b), None)

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

    def start(self, batches: list[Batch], step) -> MicrobatchGraph:
        """Begin a step over ``batches``: the loss accumulator cleared and handed to ``step``."""
        self.batches = batches
        self.loss_acc.zero_()
        step.loss_sum = self.loss_acc
        return self

    def forward(self, key, mb: int, x: torch.Tensor | None) -> None:
        """Micro-batch ``mb``'s tokens into the static buffer (the graph runs forward and backward at once)."""
        self.batch.tokens.copy_(self.batches[mb].tokens, non_blocking=True)

    def backward(self, key, mb: int, g: torch.Tensor | None) -> None:
        self.graph.replay()

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
    ``backward`` take the received tensors and return what to send, like ``pipeline.InFlight``."""

    def __init__(self, p2p: StageComm, step, example: Batch, num_mb: int):
        lay = state.layout()
        self.first, self.last = lay.is_first_stage, lay.is_last_stage
        self.loss_acc = torch.zeros((), dtype=torch.float64, device=example.tokens.device)
        step.loss_sum = self.loss_acc  # the last stage's forward adds each micro-batch's loss sum into it in place
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
                self._capture(slot, p2p, step)
        except Exception:
            self.release()
            raise

    def _capture(self, s: _Slot, p2p: StageComm, step) -> None:
        s.fwd = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread polls the eager P2P transfers' events while a stage captures
        with torch.cuda.graph(s.fwd, pool=s.pool, capture_error_mode="thread_local"):
            x = None if s.x is None else catch_grad(s.x, s.caught)
            out = step.forward(0, x, 0, s.batch)
            if self.last:
                with comm.phase("backward"):
                    step.backward(0, out, None)
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
            step.backward(0, out, g)

    # -- one step ------------------------------------------------------------------------------------------------
    def start(self, batches: list[Batch], step) -> StageGraphs:
        """Begin a step over ``batches``: the loss accumulator cleared and handed to ``step``."""
        self.batches = batches
        self.loss_acc.zero_()
        step.loss_sum = self.loss_acc
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


class CapturedSteps:
    """The CUDA-graph executor: capture when the run allows, capture again when the 2:4 operands change, and run
    eagerly (saying why, once) when a capture fails. ``in_flight`` hands the schedule this step's handler: pp = 1
    replays one captured micro-batch (``run``), pp > 1 a stage's per-slot graphs inside 1F1B (``stage``); None: run
    the step eagerly.

    ``components``: the trainer's components (None where off), asked ``capture_blocker()`` and, where they have
    it, ``prepare_replay()`` (their operands brought up to date before the replays; a new key recaptures)."""

    def __init__(self, cfg, pp: int, device: torch.device, model: torch.nn.Module, components: Iterable = ()):
        self.components = list(components)
        self.blocker = capture_blocker(cfg, pp, device, self.components)
        self.pp = pp
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
            state.log0(f"cuda graphs off: {self.blocker}")

    @property
    def active(self) -> bool:
        """A captured backward owns its ``.grad`` tensors: zero them in place, never set them to None."""
        return self.graph is not None or self.stage_graphs is not None

    def _new_operands(self, step: int) -> bool:
        """Bring the 2:4 operands up to date in place; True when they moved to new buffers (graphs that read the old
        ones are released: new masks, the autotune's switch, dense fine-tuning)."""
        key = replay_key(self.components)  # 2:4 operands updated in place
        moved = key != self.key
        if moved and self.active:
            self.release()
            self.recaptures.append(step)
        self.key = key
        return moved

    def in_flight(self, batches: list[Batch], p2p: StageComm, step, step_no: int):
        """This step's in-flight handler for the schedule (captured first when needed), or None: run it eagerly."""
        if self.pp == 1:
            return self.run(batches, step, step_no)
        return self.stage(batches, p2p, step, step_no)

    def run(self, batches: list[Batch], step, step_no: int) -> MicrobatchGraph | None:
        """pp = 1: the captured micro-batch, replayed once per batch by 1F1B (capturing it first); None: eager."""
        if self.blocker is not None:
            return None
        if self._new_operands(step_no) and _every_step(self.recaptures):
            return self._off("2:4 operands are rebuilt every step (in-place value refresh unverified)")
        if self.graph is None:
            try:
                self.graph = MicrobatchGraph(step, batches[0], list(self.model.parameters()))
            except Exception as e:  # noqa: BLE001 - an uncapturable op: say so once and stay eager
                for p in self.model.parameters():  # the warm-up passes' gradients, in place: DP bucket slices
                    if p.grad is not None:
                        p.grad.zero_()
                step.loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
                return self._off(f"capture failed ({_root_cause(e)})")
            state.log0(f"cuda graphs: one micro-batch captured, replayed {len(batches)}x per step")
        return self.graph.start(batches, step)

    def stage(self, batches: list[Batch], p2p: StageComm, step, step_no: int) -> StageGraphs | None:
        """pp > 1: this step's in-flight handler for ``one_f_one_b`` (captured before the schedule when needed), or
        None: run this step eagerly (blocked, the warm-up step before a capture, or a failed capture).

        Every operand move costs one eager step with the new operands (the warm-up) and a capture on the next: a
        stage whose operands move on three steps in a row would never replay, so it stops trying."""
        if self.blocker is not None:
            return None
        first = not self.key  # the first key (or none: no 2:4 GEMMs) is no move
        if self._new_operands(step_no) and not first:
            self.warm = False
            self.moves.append(step_no)
            if _every_step(self.moves):
                self._off("2:4 operands are rebuilt every step (in-place value refresh unverified)")
                return None
        if self.stage_graphs is None:
            if not self.warm:  # the eager step compiles kernels, times the loss and picks GEMM algorithms
                self.warm = True
                return None
            try:
                self.stage_graphs = StageGraphs(p2p, step, batches[0], len(batches))
            except Exception as e:  # noqa: BLE001 - an uncapturable op: say so once and stay eager
                step.loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
                self._off(f"capture failed ({_root_cause(e)})")
                return None
            n = len(self.stage_graphs.slots)
            what = "one graph (forward + backward)" if self.stage_graphs.last else f"{n} forward + {n} backward graphs"
            state.log0(f"cuda graphs: pipeline stage captured as {what}, replayed inside 1F1B")
        return self.stage_graphs.start(batches, step)

    def _off(self, why: str) -> None:
        """Stay eager from now on. Said on every rank it happens on: stages and TP ranks may differ (a rank that
        replays and one that runs eagerly issue the same transfers and collectives, so they still meet)."""
        self.blocker = why
        self.release()
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""
        print(f"{rank}cuda graphs off: {why}", flush=True)
        return None

    def release(self) -> None:
        if self.graph is not None:
            self.graph.release()
            self.graph = None
        if self.stage_graphs is not None:
            self.stage_graphs.release()
            self.stage_graphs = None
