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
refreshes only the values are rewritten, by a Triton packing kernel, once per optimizer step.
"""

from __future__ import annotations

import logging
import zlib

import torch

from megasparse.sparse24.masks import CUSPARSELT_ALIGN, check_cusparselt_shape, check_mask_shape
from megasparse.sparse24.mvue import mvue24

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

log = logging.getLogger("megasparse.sparse24")

BACKENDS = ("auto", "cusparselt", "emulate")


# ----------------------------------------------------------------------------------------------------------------
# value packing: kept values of W ⊙ M, two per group of four along a row, in column order
# ----------------------------------------------------------------------------------------------------------------


def pack_values_reference(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Kept values of a row-wise 2:4 masked ``w`` [r, c] as [r, c/2], row-major (torch reference)."""
    return w[mask].reshape(w.shape[0], w.shape[1] // 2)


if triton is not None:

    @triton.jit
    def _pack_kernel(w_ptr, m_ptr, o_ptr, R, G, sw0, sw1, sm0, sm1, so0, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        ok = (r[:, None] < R) & (g[None, :] < G)
        wb = w_ptr + r[:, None] * sw0 + (4 * g[None, :]) * sw1
        mb = m_ptr + r[:, None] * sm0 + (4 * g[None, :]) * sm1
        w0 = tl.load(wb, mask=ok, other=0.0)
        w1 = tl.load(wb + sw1, mask=ok, other=0.0)
        w2 = tl.load(wb + 2 * sw1, mask=ok, other=0.0)
        w3 = tl.load(wb + 3 * sw1, mask=ok, other=0.0)
        k0 = tl.load(mb, mask=ok, other=0) != 0
        k1 = tl.load(mb + sm1, mask=ok, other=0) != 0
        k2 = tl.load(mb + 2 * sm1, mask=ok, other=0) != 0
        k3 = tl.load(mb + 3 * sm1, mask=ok, other=0) != 0
        first = tl.where(k0, w0, tl.where(k1, w1, w2))
        second = tl.where(k3, w3, tl.where(k2, w2, w1))
        ob = o_ptr + r[:, None] * so0 + 2 * g[None, :]
        ty = o_ptr.dtype.element_ty
        tl.store(ob, first.to(ty), mask=ok)
        tl.store(ob + 1, second.to(ty), mask=ok)


def pack_values(w: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Kept values of ``w`` ⊙ ``mask`` (row-wise 2:4; any strides, e.g. ``W.t()``) into ``out`` [r, c/2]."""
    r, c = w.shape
    if out is None:
        out = torch.empty(r, c // 2, dtype=w.dtype, device=w.device)
    if not (w.is_cuda and triton is not None):
        out.copy_(pack_values_reference(w, mask))
        return out
    m8 = mask.view(torch.uint8)
    # Tile long along whichever input dimension is contiguous, so loads coalesce.
    br, bg = (128, 8) if w.stride(0) == 1 else (8, 128)
    grid = (triton.cdiv(r, br), triton.cdiv(c // 4, bg))
    _pack_kernel[grid](
        w, m8, out, r, c // 4, w.stride(0), w.stride(1), m8.stride(0), m8.stride(1), out.stride(0),
        BLOCK_R=br, BLOCK_G=bg,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# backend choice: a one-time micro-benchmark per GEMM shape
# ----------------------------------------------------------------------------------------------------------------

_decisions: dict[tuple, dict] = {}


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
    if key in _decisions:
        return _decisions[key]
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
    log.info(
        "sparse24: shape [%d, %d] x %d tokens %s: fwd+dgrad sparse %.3f ms vs dense %.3f ms -> %s; wgrad -> %s",
        out_f, in_f, n, dtype, t_sparse, t_dense, "cuSPARSELt" if res["sparse"] else "dense fallback",
        "cuSPARSELt" if res["sparse_wgrad"] else "dense",
    )  # fmt: skip
    _decisions[key] = res
    return res


def _values_view(packed: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """The value part of a cuSPARSELt-compressed [r, c] operand (torch returns it flat or 2-D, values first)."""
    return packed.view(-1)[: r * c // 2].view(r, c // 2)


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
        self._built_from: tuple[int, int] | None = None  # (weight._version, mask_version)
        self._masked: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.packed_t: torch.Tensor | None = None
        self._metadata_mask_version = -1
        self.fast_refresh: bool | None = None  # None: not yet verified against _cslt_compress
        self.can_sparse = self._sparse_capable(weight)

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

    def refresh(self, weight: torch.Tensor, force: bool = False) -> None:
        """Rebuild cached operands from ``weight`` if it (or the mask) changed since the last build."""
        stamp = (weight._version, self.mask_version, weight.data_ptr())
        if not force and self._built_from == stamp:
            return
        w = weight.detach()
        self._masked = w * self.mask
        if self.can_sparse:
            self._refresh_sparse(w)
        self._built_from = stamp
        self.version += 1

    def _refresh_sparse(self, w: torch.Tensor) -> None:
        r, c = self.shape
        if self._metadata_mask_version != self.mask_version or not self.fast_refresh:
            self.packed = torch._cslt_compress(self._masked)
            self.packed_t = torch._cslt_compress(self._masked.t().contiguous())
            self._metadata_mask_version = self.mask_version
            if self.fast_refresh is None:
                self.fast_refresh = self._verify_value_layout(w)
            return
        pack_values(w, self.mask, _values_view(self.packed, r, c))
        pack_values(w.t(), self.mask.t(), _values_view(self.packed_t, c, r))

    def _verify_value_layout(self, w: torch.Tensor) -> bool:
        """Check that _cslt_compress stores the kept values row-major before its metadata (then values can be
        rewritten in place); otherwise every refresh recompresses (slower, always correct)."""
        r, c = self.shape
        ok = torch.equal(_values_view(self.packed, r, c), pack_values(w, self.mask)) and torch.equal(
            _values_view(self.packed_t, c, r), pack_values(w.t(), self.mask.t())
        )
        log.info("sparse24: %s in-place value refresh %s", self.name, "verified" if ok else "unavailable: recompress")
        return ok

    def masked_weight(self, weight: torch.Tensor) -> torch.Tensor:
        self.refresh(weight)
        return self._masked

    def next_seed(self) -> int:
        self._calls += 1
        return (self._seed * 1_000_003 + self._calls) & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------------------------
# the GEMMs, on rows (the token-filter wrapper calls these with kept rows)
# ----------------------------------------------------------------------------------------------------------------


def _plan(x: torch.Tensor, state: Sparse24Weight, mvue: bool) -> dict | None:
    if not state.can_sparse or x.dtype != state._masked.dtype or x.shape[0] % 8:
        return None
    return decide(state.shape[0], state.shape[1], x.shape[0], x.dtype, x.device, mvue)


def sparse24_forward(x: torch.Tensor, weight: torch.Tensor, state: Sparse24Weight) -> torch.Tensor:
    """Y = X·S(W)ᵀ for x [n, in]."""
    state.refresh(weight)
    plan = _plan(x, state, False)
    if plan is not None and plan["sparse"]:
        x = x.contiguous()
        return torch._cslt_sparse_mm(state.packed, x.t(), transpose_result=True, alg_id=plan["alg_fwd"])
    return x @ state._masked.t()


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
            gx = torch._cslt_sparse_mm(state.packed_t, gy.t(), transpose_result=True, alg_id=plan["alg_dgrad"])
        else:
            gx = gy @ state._masked
    if need_weight_grad:
        if mvue and gy.shape[0] % 4 == 0:
            buf = torch.empty(gy.shape[1], gy.shape[0], dtype=gy.dtype, device=gy.device)  # MVUE(∇Y)ᵀ, row-major
            mvue24(gy, 0, seed=state.next_seed(), out=buf.t())
            if plan is not None and plan.get("sparse_wgrad"):
                gw = torch._cslt_sparse_mm(torch._cslt_compress(buf), x.contiguous())
            else:
                gw = buf @ x
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
