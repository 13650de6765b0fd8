"""The 2:4 sparse linear layer: Y = X·S(W)ᵀ, ∇X = ∇Y·S(W), ∇W = ∇Yᵀ·X or MVUE(∇Y)ᵀ·X.

S(W) = W ⊙ M with a transposable mask M, so both S(W) [out, in] (2:4 along in) and S(W)ᵀ
[in, out] (2:4 along out) are valid sparse operands: the forward and input-gradient GEMMs run
on sparse tensor cores through torch's cuSPARSELt ops (``torch._cslt_compress`` /
``torch._cslt_sparse_mm``; the sparse operand is always the left one, so ∇X is computed as
(S(W)ᵀ·∇Yᵀ)ᵀ with ``transpose_result``). The gradient reaches the dense W unmasked
(straight-through estimator). On CPU, for fp32, for unaligned shapes, and for shapes where a
one-time micro-benchmark finds sparse slower than dense, the same math runs as masked dense
GEMMs ("masked_dense").

Per-step cost control (see docs/decisions/0300-sparse24-operands.md): the compressed operands
hold values followed by metadata; the metadata depends only on the mask, so between mask
refreshes only the values are rewritten, by a Triton packing kernel (``pack.py``), once per optimizer step.
"""

from __future__ import annotations

import logging
import zlib

import torch

from megasparse.sparse24.masks import CUSPARSELT_ALIGN, check_cusparselt_shape, check_mask_shape
from megasparse.sparse24.mvue import mvue24
from megasparse.sparse24.pack import _values_view, pack_values, pack_values_reference

__all__ = ["Sparse24Weight", "decide", "pack_values", "pack_values_reference", "sparse24_backward",
           "sparse24_forward", "sparse24_linear"]  # fmt: skip

log = logging.getLogger("megasparse.sparse24")

BACKENDS = ("auto", "cusparselt", "emulate")


# ----------------------------------------------------------------------------------------------------------------
# backend choice: a one-time micro-benchmark per GEMM shape
# ----------------------------------------------------------------------------------------------------------------


class PlanCache:
    """Backend verdicts of ``decide``, one per (shape, tokens, dtype, device, mvue); ``reset()`` re-measures."""

    def __init__(self) -> None:
        self.plans: dict[tuple, dict] = {}

    def reset(self) -> None:
        self.plans.clear()


PLANS = PlanCache()
"""The process's verdicts: measuring a shape costs milliseconds, so every linear of that shape shares one."""


def _cuda_time(fn, iters: int = 5) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _search_alg(packed: torch.Tensor, b: torch.Tensor) -> int:
    try:
        return int(torch._cslt_sparse_mm_search(packed, b, transpose_result=True))
    except (RuntimeError, AttributeError):  # older/newer torch without search: default algorithm
        return 0


def decide(out_f: int, in_f: int, n: int, dtype: torch.dtype, device: torch.device, mvue: bool) -> dict:
    """Measure sparse vs dense once for this (shape, tokens, dtype) and cache the verdict.

    Returns {"sparse": bool (fwd+dgrad on cuSPARSELt), "sparse_wgrad": bool, "alg_fwd", "alg_dgrad", times}.
    """
    key = (out_f, in_f, n, dtype, device.index, mvue)
    if key in PLANS.plans:
        return PLANS.plans[key]
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(out_f, in_f, device=device, dtype=dtype, generator=g)
    x = torch.randn(n, in_f, device=device, dtype=dtype, generator=g)
    gy = torch.randn(n, out_f, device=device, dtype=dtype, generator=g)
    from megasparse.sparse24.masks import transposable_mask

    m = transposable_mask(w)
    ws = w * m
    packed, packed_t = torch._cslt_compress(ws), torch._cslt_compress(ws.t().contiguous())
    a_f, a_d = _search_alg(packed, x.t()), _search_alg(packed_t, gy.t())
    t_sparse = _cuda_time(lambda: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True, alg_id=a_f))
    t_sparse += _cuda_time(lambda: torch._cslt_sparse_mm(packed_t, gy.t(), transpose_result=True, alg_id=a_d))
    t_dense = _cuda_time(lambda: torch.nn.functional.linear(x, ws)) + _cuda_time(lambda: gy @ ws)
    res = {"sparse": t_sparse < t_dense, "t_sparse_ms": t_sparse, "t_dense_ms": t_dense, "alg_fwd": a_f}
    res["alg_dgrad"] = a_d
    res["sparse_wgrad"] = False
    if mvue and n % CUSPARSELT_ALIGN == 0:
        buf = torch.empty(out_f, n, device=device, dtype=dtype)

        def sparse_wgrad():
            mvue24(gy, 0, seed=1, out=buf.t())
            return torch._cslt_sparse_mm(torch._cslt_compress(buf), x)

        def dense_wgrad():
            mvue24(gy, 0, seed=1, out=buf.t())
            return buf @ x

        tw_s, tw_d = _cuda_time(sparse_wgrad), _cuda_time(dense_wgrad)
        res.update(sparse_wgrad=tw_s < tw_d, t_wgrad_sparse_ms=tw_s, t_wgrad_dense_ms=tw_d)
    msg = (
        f"sparse24: shape [{out_f}, {in_f}] x {n} rows {str(dtype).replace('torch.', '')}: fwd+dgrad cuSPARSELt "
        f"{t_sparse:.3f} ms vs dense {t_dense:.3f} ms -> {'cuSPARSELt' if res['sparse'] else 'dense GEMMs'}; "
        f"wgrad -> {'cuSPARSELt' if res['sparse_wgrad'] else 'dense'}"
    )
    log.info(msg)
    # the run says which shapes chose what (issue 11), once per shape, on the first rank's console
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)
    PLANS.plans[key] = res
    return res


# ----------------------------------------------------------------------------------------------------------------
# per-linear state
# ----------------------------------------------------------------------------------------------------------------


class Sparse24Weight:
    """Mask, cached operands and backend of one sparse linear's weight (shard).

    ``version`` counts value refreshes; ``mask_version`` counts mask changes. Operands are rebuilt
    lazily when the weight's storage version differs from the one they were built from, and eagerly
    by ``refresh`` (SparsityManager.after_step calls it once per optimizer step; optimizers that write
    through ``.data`` bypass the version counter, so that call is the contract).
    """

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, backend: str = "auto", name: str = "weight"):
        if backend not in BACKENDS:
            raise ValueError(f"Sparse24Weight: backend={backend!r}, use one of {BACKENDS}")
        check_mask_shape(weight.shape, name)
        self.name = name
        self.requested_backend = backend
        self.shape = tuple(weight.shape)
        self.mask = mask.to(device=weight.device, dtype=torch.bool)
        self.version = 0
        self.mask_version = 0
        self._seed = zlib.crc32(name.encode()) & 0xFFFF
        self._calls = 0
        self._built_from: tuple[int, int, int] | None = None  # (weight._version, mask_version, data_ptr)
        self._masked: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.packed_t: torch.Tensor | None = None
        self._metadata_mask_version = -1
        self.fast_refresh: list[bool | None] = [None, None]  # per operand (W, Wᵀ), for the current mask
        self.layout_note = ""
        self._w = weight.detach()
        self.can_sparse = self._sparse_capable(weight)
        self._use_sparse = True
        self._reads: set[str] | None = None
        """Operands the GEMMs have read since the plans last changed ("packed", "masked"); None: not known yet."""
        self._masked_at = -1  # the version _masked was built at
        self.source_masked = False
        """True: the weight given to ``refresh`` is W ⊙ M already (a 2:4 GEMM's compute copy): no product is made."""
        self._packed_at = -1

    @property
    def use_sparse(self) -> bool:
        """False: masked dense GEMMs (same arithmetic); set by the step-level autotune when they are faster."""
        return self._use_sparse

    @use_sparse.setter
    def use_sparse(self, value: bool) -> None:
        if value != self._use_sparse:
            self._reads = None  # other GEMMs now: learn again which operands they read
        self._use_sparse = value

    def note_read(self, operand: str) -> None:
        """A GEMM read ``operand``: refreshes keep building it eagerly (a captured graph replays without Python,
        so what it reads must be current before each replay)."""
        if self._reads is None:
            self._reads = set()
        self._reads.add(operand)

    def _wants(self, operand: str) -> bool:
        return self._reads is None or operand in self._reads

    def _sparse_capable(self, weight: torch.Tensor) -> bool:
        if self.requested_backend == "emulate" or not weight.is_cuda:
            return False
        if weight.dtype not in (torch.bfloat16, torch.float16):
            if self.requested_backend == "cusparselt":
                raise ValueError(f"sparsity: {self.name} is {weight.dtype}; the cuSPARSELt backend needs bf16/fp16")
            return False
        if self.requested_backend == "cusparselt":
            check_cusparselt_shape(weight.shape, self.name)
            return True
        if weight.shape[0] % CUSPARSELT_ALIGN or weight.shape[1] % CUSPARSELT_ALIGN:
            log.info(
                "sparse24: %s shape %s not %d-aligned: masked dense GEMMs", self.name, self.shape, CUSPARSELT_ALIGN
            )
            return False
        return True

    # -- mask / value refresh ------------------------------------------------------------------------------------
    def set_mask(self, mask: torch.Tensor) -> None:
        """Install a new mask; compressed metadata is rebuilt at the next refresh."""
        self.mask = mask.to(device=self.mask.device, dtype=torch.bool)
        self.mask_version += 1
        self._built_from = None

    def invalidate(self) -> None:
        """The weight's values changed without its version counter moving (written by a kernel): rebuild at the next
        refresh."""
        self._built_from = None

    def refresh(self, weight: torch.Tensor, force: bool = False) -> None:
        """Rebuild cached operands from ``weight`` if it (or the mask) changed since the last build."""
        stamp = (weight._version, self.mask_version, weight.data_ptr())
        if not force and self._built_from == stamp:
            return
        self._w = weight.detach()
        self.version += 1
        self._built_from = stamp
        # Only the operands the GEMMs read are rebuilt here: at a shape where every GEMM runs sparse, W ⊙ M is
        # unused, and where the per-shape plans all chose dense GEMMs the packed values are (2.9 and 2.7 ms a
        # step on TinyLlama, one H100). Until the GEMMs have run once with these plans, both are built.
        if self._masked is not None and self._masked.shape != self._w.shape:
            self._masked = None
        if self._masked is not None and self._wants("masked"):  # never made when source_masked
            # in place: a captured step (megasparse/cudagraph.py) keeps reading this buffer
            torch.mul(self._w, self.mask, out=self._masked)
            self._masked_at = self.version
        if self.can_sparse and self.use_sparse and self._wants("packed"):
            self._refresh_sparse(self._w)
            self._packed_at = self.version

    def sparse_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed S(W), packed S(W)ᵀ) of the last refresh, packed now if that refresh skipped them."""
        self.note_read("packed")
        if self._packed_at != self.version:
            self._refresh_sparse(self._w)
            self._packed_at = self.version
        return self.packed, self.packed_t

    def dense_weight(self) -> torch.Tensor:
        """W ⊙ M of the last refresh (for the masked-dense GEMMs), built now if that refresh skipped it."""
        self.note_read("masked")
        if self.source_masked:
            return self._w
        if self._masked is None:
            self._masked = self._w * self.mask
        elif self._masked_at != self.version:
            torch.mul(self._w, self.mask, out=self._masked)
        self._masked_at = self.version
        return self._masked

    def _refresh_sparse(self, w: torch.Tensor) -> None:
        r, c = self.shape
        new_metadata = self._metadata_mask_version != self.mask_version
        src = None
        for i, transpose in enumerate((False, True)):
            rows, cols = (c, r) if transpose else (r, c)
            if new_metadata or not self.fast_refresh[i]:
                if src is None:
                    src = self._metadata_source(w)
                packed = torch._cslt_compress(src.t().contiguous() if transpose else src)
                if transpose:
                    self.packed_t = packed
                else:
                    self.packed = packed
                if new_metadata:  # re-checked at every metadata build: a mismatch is data-dependent (decision 0300)
                    self.fast_refresh[i] = self._verify_value_layout(src, packed, transpose)
                if not self.fast_refresh[i]:
                    continue
            # values only: the metadata already encodes the mask
            dst = _values_view(self.packed_t if transpose else self.packed, rows, cols)
            pack_values(w, self.mask, dst, transpose)
        self._metadata_mask_version = self.mask_version

    def _metadata_source(self, w: torch.Tensor) -> torch.Tensor:
        """W ⊙ M with kept exact zeros nudged to the dtype's smallest normal: _cslt_compress derives positions
        from non-zeros, so a kept zero could otherwise be encoded at another position than the mask says."""
        src = torch.where(self.mask, w, torch.zeros((), dtype=w.dtype, device=w.device))
        return src.masked_fill_(self.mask & (w == 0), torch.finfo(w.dtype).tiny)

    def _verify_value_layout(self, w: torch.Tensor, packed: torch.Tensor, transpose: bool) -> bool:
        """Does _cslt_compress store the kept values row-major ahead of its metadata? Then values can be rewritten
        in place each step; otherwise this operand is recompressed at every refresh of this mask (slower, correct)."""
        r, c = self.shape
        rows, cols = (c, r) if transpose else (r, c)
        mine = pack_values(w, self.mask, transpose=transpose)
        theirs = _values_view(packed, rows, cols)
        ok = torch.equal(theirs, mine)
        if not ok:
            same_set = torch.equal(theirs.flatten().sort().values, mine.flatten().sort().values)
            rows_ok = float((theirs == mine).all(dim=1).float().mean())
            self.layout_note = (
                f"{'Wt' if transpose else 'W'} {rows}x{cols}: permuted={same_set} rows_equal={rows_ok:.3f}"
            )
        log.info(
            "sparse24: %s %s in-place value refresh %s",
            self.name, "Wᵀ" if transpose else "W", "verified" if ok else "unavailable, recompressing",
        )  # fmt: skip
        return ok

    def next_seed(self) -> int:
        self._calls += 1
        return (self._seed * 1_000_003 + self._calls) & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------------------------
# the GEMMs, on rows (the token-filter wrapper calls these with kept rows)
# ----------------------------------------------------------------------------------------------------------------


def _plan(x: torch.Tensor, state: Sparse24Weight, mvue: bool) -> dict | None:
    if not state.can_sparse or not state.use_sparse or x.dtype != state._w.dtype or x.shape[0] % 8:
        return None
    return decide(state.shape[0], state.shape[1], x.shape[0], x.dtype, x.device, mvue)


def sparse24_forward(x: torch.Tensor, weight: torch.Tensor, state: Sparse24Weight) -> torch.Tensor:
    """Y = X·S(W)ᵀ for x [n, in]."""
    state.refresh(weight)
    plan = _plan(x, state, False)
    if plan is not None and plan["sparse"]:
        x = x.contiguous()
        packed = state.sparse_operands()[0]
        return torch._cslt_sparse_mm(packed, x.t(), transpose_result=True, alg_id=plan["alg_fwd"])
    return x @ state.dense_weight().t()


def sparse24_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    state: Sparse24Weight,
    mvue: bool,
    need_input_grad: bool = True,
    need_weight_grad: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(∇X, ∇W) for rows ``grad_y`` [k, out] and the matching input rows ``x`` [k, in]."""
    state.refresh(weight)
    gy = grad_y.contiguous()
    plan = _plan(gy, state, mvue)
    gx = gw = None
    if need_input_grad:
        if plan is not None and plan["sparse"]:
            packed_t = state.sparse_operands()[1]
            gx = torch._cslt_sparse_mm(packed_t, gy.t(), transpose_result=True, alg_id=plan["alg_dgrad"])
        else:
            gx = gy @ state.dense_weight()
    if need_weight_grad:
        if mvue and gy.shape[0] % 4 == 0:
            if plan is not None and plan.get("sparse_wgrad"):
                buf = torch.empty(gy.shape[1], gy.shape[0], dtype=gy.dtype, device=gy.device)  # MVUE(∇Y)ᵀ row-major
                mvue24(gy, 0, seed=state.next_seed(), out=buf.t())
                gw = torch._cslt_sparse_mm(torch._cslt_compress(buf), x.contiguous())
            else:  # same estimator, natural layout (coalesced writes), dense GEMM
                gw = mvue24(gy, 0, seed=state.next_seed()).t() @ x
        else:
            gw = gy.t() @ x
        gw = gw.to(weight.dtype)
    return gx, gw


class Sparse24LinearFn(torch.autograd.Function):
    """Autograd wrapper of sparse24_forward / sparse24_backward (straight-through: ∇W goes to dense W)."""

    @staticmethod
    def forward(ctx, x, weight, state, mvue):
        ctx.save_for_backward(x)
        ctx.state, ctx.mvue, ctx.weight = state, mvue, weight
        return sparse24_forward(x, weight, state)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        if grad_y.shape[0] != x.shape[0]:
            raise RuntimeError(
                f"sparse24_linear: gradient has {grad_y.shape[0]} rows, forward had {x.shape[0]}; a compacted "
                "backward must call sparse24_backward with the kept rows of x"
            )
        gx, gw = sparse24_backward(
            grad_y, x, ctx.weight, ctx.state, ctx.mvue, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return gx, gw, None, None


def sparse24_linear(x: torch.Tensor, weight: torch.Tensor, state: Sparse24Weight, mvue: bool = False):
    """x [n, in] · S(W)ᵀ -> [n, out], with 2:4 sparse GEMMs where they pay off. ``state=None`` means dense."""
    if state is None:
        return torch.nn.functional.linear(x, weight)
    if x.dim() != 2:
        raise ValueError(f"sparse24_linear: x must be 2-D [tokens, in], got {list(x.shape)}; flatten first")
    if tuple(weight.shape) != state.shape:
        raise ValueError(f"sparse24_linear: weight {list(weight.shape)} does not match its state {list(state.shape)}")
    return Sparse24LinearFn.apply(x, weight, state, mvue)
