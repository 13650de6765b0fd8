"""The distributed optimizer (``parallel.distributed_optimizer``) and the trainer's one handle on the optimizer step.

``DistributedAdamW``: every DP rank owns a contiguous 1/dp of each gradient bucket (``ddp.py``) and keeps, for
that chunk only, the fp32 master weights and AdamW's two moments, so their memory divides by dp. It steps its
chunk with ``torch.optim.AdamW`` itself (fused on CUDA as the replicated optimizer is, decision 1238; on views: one
per parameter piece inside the chunk, in the plain optimizer's decay groups, so the arithmetic is the replicated
optimizer's, element for element), then all-gathers the updated parameters into the bucket's parameter storage
(bf16 compute copies on GPU, the fp32 weights themselves on CPU) asynchronously, in the order the next forward
uses them (``gather_order``, decision 1240); that forward waits for a bucket in the pre-hook of the first module
that uses it. The gradient norm sums squares of the owned chunks over the whole world, which equals the replicated
norm (TP shards counted once each, TP-replicated parameters on TP rank 0 only).

Checkpoints: ``state_dict`` gathers the chunks over DP into exactly the structure ``torch.optim.AdamW`` has
(whole per-parameter moments), and ``plain_view`` lends ``checkpoint.py`` a plain AdamW over the model's
parameters holding them (fp32 weights swapped in where the parameters are bf16), scattering back after a load.
So a save reads like a replicated one and resumes at any DP size. The cost: a transient whole copy of the
optimizer state on every rank during a save or load (docs/decisions/0404).

``take_pieces``: a caller may apply one step's update to some parameters' owned pieces itself, on this optimizer's
own fp32 masters and moments (the 2:4 recipe's fused masked AdamW, decision 1237); the step leaves those pieces out
of its AdamW, counts their step and gathers them like the rest. The caller sees pieces, never buckets.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megasparse.parallel import comm, grads, state, tied
from megasparse.parallel.ddp import GradBuckets
from megasparse.parallel.layers import ComputeCopies

__all__ = ["DataParallelOptimizer", "DistributedAdamW"]

Groups = list[tuple[list[nn.Parameter], float]]
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")  # how a run steps, not what a checkpoint holds


def _wait(works: list, which: list[int] | None = None, quiet: bool = False) -> list[int]:
    """Complete the pending all-gathers ``which`` (None: all) of ``works``, emptying their slots; the slots that
    held one. ``quiet``: for an optimizer being dropped, whose group may be torn down already (nothing to hold)."""
    done = []
    for k in range(len(works)) if which is None else which:
        if works[k] is not None:
            try:
                works[k].wait()
            except Exception:  # noqa: BLE001
                if not quiet:
                    raise
            works[k] = None
            done.append(k)
    return done


@dataclass
class OwnedPiece:
    """This rank's piece of one parameter, lent to a caller that steps it itself (``DistributedAdamW.take_pieces``).
    Every tensor is a contiguous 1-D view of the optimizer's own storage: writes land in its state."""

    param: nn.Parameter
    start: int
    """[start, end) of the parameter's flattened elements."""
    end: int
    master: torch.Tensor
    """fp32 master weights (the parameter itself when it is fp32)."""
    grad: torch.Tensor
    """The DP-reduced, clipped gradient."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    group: dict
    """The AdamW parameter group it steps in (lr, betas, eps, weight_decay, amsgrad, maximize)."""


class DistributedAdamW:
    """AdamW over this DP rank's chunk of every bucket; parameters are all-gathered after each step."""

    @classmethod
    def capture_blocker(cls) -> str:
        """Why a CUDA graph cannot capture a backward that feeds this optimizer; ``cudagraph`` asks the class (the
        answer is needed before the optimizer is built: it decides whether gradient buckets start from hooks)."""
        return "parallel.distributed_optimizer (bf16 gradients reach fp32 buffers through hooks; gathers are waited on)"

    def __init__(
        self,
        buckets: GradBuckets,
        groups: Groups,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        foreach: bool,
        param_dtype: torch.dtype,
        lazy_gather: bool,
        fused: bool = False,
    ) -> None:
        """``groups``: (parameters, weight decay) in the plain optimizer's order; ``param_dtype``: the dtype the
        model's parameters are switched to (the compute dtype); ``lazy_gather``: wait for a bucket's gathered
        parameters only when a module needs them (``wait_before_use``), else at the end of ``step``; ``fused``:
        torch's one-kernel AdamW over the pieces (its step counts then live on the device; decision 1238)."""
        self.buckets, self.groups, self.lazy = buckets, groups, lazy_gather
        self.hyper = dict(lr=lr, betas=betas, eps=eps, foreach=foreach and not fused, fused=fused)
        n, r = buckets.dp, buckets.rank
        decay = {id(p): k for k, (ps, _) in enumerate(groups) for p in ps}
        pieces: list[list[torch.Tensor]] = [[] for _ in groups]
        self.masters, self.moments, self.works = [], [], []
        # gathers still in flight when the optimizer goes (a caller of train_step that drops the trainer; train()
        # waits at its end): waited for then, else NCCL keeps their tensors, a stage's parameters, for good
        weakref.finalize(self, _wait, self.works, None, True).atexit = False
        self.pieces: list[list[tuple[int, int, int, torch.Tensor]]] = []  # per bucket: (param idx, s, e, master view)
        init_state: dict[torch.Tensor, dict] = {}
        for b in buckets.buckets:
            lo, hi = b.shard(r, n)
            full = torch.zeros(b.numel, dtype=torch.float32, device=b.grad.device)
            for p, (s, e) in zip(b.params, b.ranges):
                full[s:e] = p.detach().reshape(-1).float()
                p.grad = None  # its dtype may change below; GradBuckets.zero reinstalls it
            b.data = full if param_dtype == torch.float32 else full.to(param_dtype)
            for p, (s, e) in zip(b.params, b.ranges):
                p.data = b.data[s:e].view(p.shape)
            master = b.data[lo:hi] if param_dtype == torch.float32 else full[lo:hi].clone()
            m, v = torch.zeros_like(master), torch.zeros_like(master)
            self.masters.append(master)
            self.moments.append((m, v))
            self.works.append(None)
            mine = []
            for i, s, e in b.segments(lo, hi):
                view = master[s - lo : e - lo]
                view.grad = b.grad[s:e]
                pieces[decay[id(b.params[i])]].append(view)
                step = torch.zeros((), dtype=torch.float32, device=view.device if fused else "cpu")
                init_state[view] = {"step": step, "exp_avg": m[s - lo : e - lo]}
                init_state[view]["exp_avg_sq"] = v[s - lo : e - lo]
                mine.append((i, s, e, view))
            self.pieces.append(mine)
        self._owned = {id(p): (0, 0) for b in buckets.buckets for p in b.params}
        for b, mine in zip(buckets.buckets, self.pieces):
            for i, s, e, _ in mine:  # a parameter is contiguous and so is the chunk: one range each
                a = b.ranges[i][0]
                self._owned[id(b.params[i])] = (s - a, e - a)
        self.inner = torch.optim.AdamW(
            [{"params": ps, "weight_decay": wd} for ps, (_, wd) in zip(pieces, groups)], **self.hyper
        )
        for view, st in init_state.items():  # AdamW initialises only empty state: it steps these views
            self.inner.state[view] = st
        self._group_of = decay  # parameter id -> its group's index
        self._taken: list[torch.Tensor] = []  # master views a caller steps itself at the next ``step``
        self.steps = 0
        buckets.zero(1)
        self._hooks: list = []
        self._order: list[int] = []
        """The buckets in the order the next forward waits for them (``wait_before_use``); empty: no pre-hooks."""

    # -- what the trainer reads and sets -----------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def state_bytes(self) -> int:
        """Bytes of fp32 master weights and AdamW moments this rank holds."""
        return sum(3 * m.numel() * 4 for m in self.masters)

    def owned_range(self, p: nn.Parameter) -> tuple[int, int]:
        """[start, end) of ``p``'s flattened elements this rank steps ((0, 0): another rank owns them all). Only
        that part of ``p.main_grad`` is reduced here and read by the step, so per-step gradient work (the 2:4
        masked decay) need touch nothing else."""
        try:
            return self._owned[id(p)]
        except KeyError:
            raise KeyError(f"a {tuple(p.shape)} parameter is not in this optimizer's gradient buckets") from None

    def take_pieces(self, wanted: Callable[[nn.Parameter], bool]) -> tuple[list[OwnedPiece], int]:
        """This rank's pieces of the parameters ``wanted`` selects, for a caller that applies this step's update to
        them itself (before the next ``step``, after clipping), and the 1-based number of that step (a host count:
        no synchronisation). The next ``step`` leaves them out of its AdamW, counts their step in the state (a later
        plain step, e.g. 2:4's dense fine-tuning, continues the bias correction) and gathers them as usual. Taking
        twice before a step would update them twice: refused."""
        if self._taken:
            raise RuntimeError("take_pieces: pieces were already taken for this step")
        out = []
        for b, mine in zip(self.buckets.buckets, self.pieces):
            for i, s, e, view in mine:
                p = b.params[i]
                if not wanted(p):
                    continue
                a, st = b.ranges[i][0], self.inner.state[view]
                group = self.inner.param_groups[self._group_of[id(p)]]
                out.append(OwnedPiece(p, s - a, e - a, view, view.grad, st["exp_avg"], st["exp_avg_sq"], group))
                self._taken.append(view)
        return out, self.steps + 1

    # -- the step -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned chunks (their gradients already reduced and clipped; pieces a caller took are already
        stepped), then the parameters' all-gather over DP (waited for here unless ``lazy_gather``)."""
        taken, self._taken = self._taken, []
        hidden = [(v, v.grad) for v in taken]
        for v in taken:
            v.grad = None  # torch's AdamW skips a parameter without a gradient
        try:
            self.inner.step()
        finally:
            for v, g in hidden:
                v.grad = g
        if taken:  # host-side scalars (or one foreach add on the device): no synchronisation
            torch._foreach_add_([self.inner.state[v]["step"] for v in taken], 1.0)
        self.steps += 1
        b_all = self.buckets
        for k in self.gather_order():
            b = b_all.buckets[k]
            lo, hi = b.shard(b_all.rank, b_all.dp)
            if b.data.dtype != torch.float32:
                b.data[lo:hi].copy_(self.masters[k])
            with comm.phase("optim"):
                self.works[k] = comm.all_gather_into(b.data, b.data[lo:hi], b_all.group, "dp", region="params.dp")
            if self.works[k] is None:  # one DP rank: nothing to wait for
                self._changed(k)
        comm.defer(self.wait_params)
        if not self.lazy:
            self.wait_params()

    def gather_order(self) -> list[int]:
        """Buckets in the order the next forward waits for them (``wait_before_use``'s pre-hooks: the root module's
        own parameters, then the embedding, the blocks, ...), else the reverse of the backward's order. The
        collectives run one after another on one stream, so gathering in the backward's order (the output layer
        first, the embedding last) made the forward's first block wait for every bucket; in this order each module
        waits for its own, and the later buckets arrive while the earlier layers compute."""
        return self._order or list(reversed(range(len(self.buckets.buckets))))

    def wait_params(self, which: list[int] | None = None) -> None:
        """Wait for the gathered parameters of buckets ``which`` (all by default)."""
        for k in _wait(self.works, which):
            self._changed(k)

    def _changed(self, k: int) -> None:
        """The parameters were written through their shared storage, behind their own version counters (``p.data``
        assignment gives each its own): bump them so caches keyed on ``_version`` (the 2:4 operands) rebuild."""
        torch.autograd.graph.increment_version(self.buckets.buckets[k].params)

    def wait_before_use(self, model: nn.Module) -> None:
        """Forward pre-hooks: a module waits for the buckets of the parameters it owns, so the all-gather of later
        layers overlaps the forward of earlier ones."""
        where = {id(p): b.index for b in self.buckets.buckets for p in b.params}
        order: list[int] = []
        for mod in model.modules():  # the root first, then in registration order, which follows the forward
            mine = sorted({where[id(p)] for p in mod.parameters(recurse=False) if id(p) in where}, reverse=True)
            if mine:
                self._hooks.append(mod.register_forward_pre_hook(lambda *_, k=mine: self.wait_params(k)))
                order += [k for k in mine if k not in order]
        rest = [k for k in reversed(range(len(self.buckets.buckets))) if k not in order]
        self._order = order + rest

    # -- gradients: norm and clipping over the owned chunks ------------------------------------------------------------
    def grad_norm(self, counted: Callable[[nn.Parameter], bool], device: torch.device) -> float:
        """The whole model's gradient L2 norm from the owned chunks, summed over every rank."""
        pieces = zip(self.buckets.buckets, self.pieces)
        gs = [view.grad for b, mine in pieces for i, _, _, view in mine if counted(b.params[i])]
        return grads.norm_over(gs, None, "world", device)

    def scale_grads(self, factor: float) -> None:
        gs = [view.grad for mine in self.pieces for *_, view in mine]
        if gs:
            torch._foreach_mul_(gs, factor)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _gather(self, t: torch.Tensor, k: int) -> torch.Tensor:
        b = self.buckets.buckets[k]
        out = torch.empty(b.numel, dtype=t.dtype, device=t.device)
        lo, hi = b.shard(self.buckets.rank, self.buckets.dp)
        out[lo:hi].copy_(t)
        with comm.phase("checkpoint"):
            work = comm.all_gather_into(out, out[lo:hi], self.buckets.group, "dp", region="optim.state")
        if work is not None:
            work.wait()
        return out

    def full_state(self) -> tuple[dict[nn.Parameter, dict], dict[nn.Parameter, torch.Tensor]]:
        """Every parameter's whole AdamW state and fp32 master weight, gathered over DP (on every rank)."""
        st, masters = {}, {}
        step = torch.tensor(float(self.steps), dtype=torch.float32)
        for k, b in enumerate(self.buckets.buckets):
            w, m, v = (self._gather(t, k) for t in (self.masters[k], *self.moments[k]))
            for p, (s, e) in zip(b.params, b.ranges):
                masters[p] = w[s:e].view(p.shape).clone()
                st[p] = {"step": step.clone(), "exp_avg": m[s:e].view(p.shape).clone()}
                st[p]["exp_avg_sq"] = v[s:e].view(p.shape).clone()
        return st, masters

    def load_full_state(self, st: dict[nn.Parameter, dict], masters: dict[nn.Parameter, torch.Tensor] | None) -> None:
        """Take this rank's chunks of whole per-parameter state (and fp32 weights); no collective needed."""
        self.steps = max((int(s["step"]) for s in st.values()), default=0)
        with torch.no_grad():
            for k, b in enumerate(self.buckets.buckets):
                lo = b.shard(self.buckets.rank, self.buckets.dp)[0]
                m, v = self.moments[k]
                for i, s, e, view in self.pieces[k]:
                    p, a = b.params[i], b.ranges[i][0]
                    if p in st:
                        m[s - lo : e - lo].copy_(st[p]["exp_avg"].reshape(-1)[s - a : e - a])
                        v[s - lo : e - lo].copy_(st[p]["exp_avg_sq"].reshape(-1)[s - a : e - a])
                    self.inner.state[view]["step"].fill_(float(self.steps))
                    if masters is not None:
                        view.copy_(masters[p].reshape(-1)[s - a : e - a])
        if masters is not None:  # the compute copies from the new masters
            for k, b in enumerate(self.buckets.buckets):
                lo, hi = b.shard(self.buckets.rank, self.buckets.dp)
                with torch.no_grad():
                    b.data[lo:hi].copy_(self.masters[k])
                with comm.phase("checkpoint"):
                    self.works[k] = comm.all_gather_into(b.data, b.data[lo:hi], self.buckets.group, "dp", "params.dp")
            self.wait_params()
            for k in range(len(self.works)):
                self._changed(k)

    def _index(self) -> list[nn.Parameter]:
        return [p for ps, _ in self.groups for p in ps]

    def state_dict(self) -> dict:
        """``torch.optim.AdamW.state_dict()``'s structure, with whole moments (gathered over DP; a collective)."""
        st, _ = self.full_state()
        order = self._index()
        groups, start = [], 0
        for g, (ps, _) in zip(self.inner.param_groups, self.groups):
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(ps)))}
            )
            start += len(ps)
        return {"state": {i: st[p] for i, p in enumerate(order)}, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """Load a plain AdamW state dict (from any DP size); hyper-parameters come from it as in torch."""
        order = self._index()
        self.load_full_state({order[i]: s for i, s in sd["state"].items()}, None)
        for g, saved in zip(self.inner.param_groups, sd["param_groups"]):  # hyper-parameters, not this run's kernel
            g.update({k: v for k, v in saved.items() if k not in ("params", *_KERNEL_KEYS)})

    @contextlib.contextmanager
    def plain_view(self, load: bool = False) -> Iterator[torch.optim.AdamW]:
        """A plain AdamW over the model's parameters holding the whole state, and fp32 weights in parameters that
        are bf16, for ``checkpoint.py``; after a ``load`` what it then holds becomes this optimizer's state."""
        self.wait_params()
        if load:  # checkpoint.py materialises the state it loads into; bf16 parameters need fp32 room
            params = [p for ps, _ in self.groups for p in ps]
            st = {}
            masters = {p: p.data if p.dtype == torch.float32 else torch.zeros(p.shape, device=p.device) for p in params}
        else:
            st, masters = self.full_state()
        swapped = {p: p.data for p in masters if p.dtype != torch.float32}
        for p in swapped:
            p.data = masters[p]
        plain = {k: v for k, v in self.hyper.items() if k != "fused"}  # it holds state; it never steps
        shadow = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for ps, wd in self.groups], **plain)
        for p, s in st.items():
            shadow.state[p] = s
        for g, mine in zip(shadow.param_groups, self.inner.param_groups):
            g["lr"] = mine["lr"]
        try:
            yield shadow
            if load:  # not after a failed load: the run stops with its error and the state stays as it was
                self.load_full_state(dict(shadow.state), {p: p.data.float() for p in masters})
        finally:
            for p, data in swapped.items():
                p.data = data


class DataParallelOptimizer:
    """What the trainer calls around one optimizer step, the same for a replicated and a distributed AdamW."""

    def __init__(self, model: nn.Module, buckets: GradBuckets, optimizer, device: torch.device) -> None:
        self.model, self.buckets, self.optimizer, self.device = model, buckets, optimizer, device
        self.sharded = isinstance(optimizer, DistributedAdamW)
        self.copies: ComputeCopies | None = None

    def keep_compute_copies(self) -> None:
        """Cast the fp32 masters to the compute dtype once per step, not per micro-batch and layer (decision 0009).
        Call once the model is final (after the 2:4 converter, whose GEMMs keep their own operands)."""
        self.copies = ComputeCopies(self.model)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, micro_batches: int = 1) -> None:
        self.buckets.zero(micro_batches)

    def reduce(self) -> None:
        """After the backward: every bucket reduced over DP (and the SP norms over TP); tied embedding copies summed."""
        self.buckets.finish()
        if tied.tied_embedding(self.model) is not None:
            tied.sum_tied_grads(self.model, state.embedding_group())

    def grad_norm(self) -> float:
        if not self.sharded:
            return grads.global_grad_norm(self.model.named_parameters(), self.model.param_is_sharded, self.device)
        tp_rank = state.layout().tp_rank
        return self.optimizer.grad_norm(lambda p: hasattr(p, "tp_spec") or tp_rank == 0, self.device)

    def clip(self, gnorm: float, max_norm: float) -> None:
        if max_norm > 0 and gnorm > max_norm:
            factor = max_norm / (gnorm + 1e-6)
            if self.sharded:
                self.optimizer.scale_grads(factor)
            else:
                torch._foreach_mul_([p.grad for p in self.model.parameters() if p.grad is not None], factor)

    def step(self, wait: bool = False) -> None:
        """The optimizer step; ``wait``: the updated parameters are whole on return (the 2:4 hooks read them)."""
        self.optimizer.step()
        if self.copies is not None:
            self.copies.refresh()
        if wait:
            self.wait_params()

    def wait_params(self) -> None:
        if self.sharded:
            self.optimizer.wait_params()

    def checkpoint_view(self, load: bool = False):
        """The optimizer as ``checkpoint.py`` expects it: a plain AdamW with whole per-parameter state."""
        if self.sharded:
            return self.optimizer.plain_view(load)
        return self._refreshing(load)

    @contextlib.contextmanager
    def _refreshing(self, load: bool):
        yield self.optimizer
        if load and self.copies is not None:  # the masters were just replaced
            self.copies.refresh()

    def state_bytes(self) -> int:
        """fp32 master weights plus AdamW moments held by this rank (replicated: 12 bytes per local parameter)."""
        if self.sharded:
            return self.optimizer.state_bytes()
        return sum(12 * p.numel() for p in self.model.parameters())
