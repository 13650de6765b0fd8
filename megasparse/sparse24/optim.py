"""The 2:4 weights' optimizer step as one Triton kernel: masked decay, AdamW and the bf16 compute copy together.

Why: around a plain AdamW step the 2:4 recipe adds the masked decay (g += λ·¬M⊙W: read g, W, M, write g) and a
bf16 copy of every sparse weight for its GEMM operands. On TinyLlama-1.1B (761 M FFN weights, one H100) that was
7.6 ms a step, about 1.2%, which the FFN GEMMs do not pay back at those shapes, so turning 2:4 on made the step
slower (decision 0011). The kernel reads W, g, the moments and M once and writes W, the moments and the bf16 copy
once: fewer bytes per weight than a dense step's AdamW plus its compute copy.

The arithmetic is ``torch.optim.AdamW``'s (decoupled weight decay, then Adam with bias correction; no amsgrad, no
maximize), applied to g + λ·¬M⊙W, the gradient ``SparsityManager.apply_masked_decay`` would have produced. The
state lives in the torch optimizer's own ``state[p]`` in its fused layout, so checkpoints and a later plain step
(dense fine-tuning) see an ordinary AdamW.

Under the distributed optimizer the same kernel steps the pieces of the 2:4 weights that this DP rank owns, on the
optimizer's fp32 master, gradient and moment pieces (``DistributedAdamW.take_pieces``) with the mask's matching
flat slice; the decay reads the fp32 master as the replicated fused step does (decision 1237).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None

BLOCK = 2048


def masked_adamw_reference(
    p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, mask: torch.Tensor,
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decay: float,
) -> None:  # fmt: skip
    """In place, in torch ops: AdamW step number ``step`` (1-based) with gradient g + decay·¬M⊙p."""
    g = g + decay * p * (~mask)
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


if triton is not None:

    @triton.jit
    def _masked_adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, mask_ptr, out_ptr, n,
        lr, beta1, beta2, eps, keep_w, decay, step_size, bc2_sqrt,
        WRITE_OUT: tl.constexpr, MASK_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        p = tl.load(p_ptr + offs, mask=live, other=0.0)
        g = tl.load(g_ptr + offs, mask=live, other=0.0)
        keep = tl.load(mask_ptr + offs, mask=live, other=1).to(tl.float32)
        g = g + decay * p * (1.0 - keep)
        p = p * keep_w
        m = tl.load(m_ptr + offs, mask=live, other=0.0)
        v = tl.load(v_ptr + offs, mask=live, other=0.0)
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=live)
        tl.store(m_ptr + offs, m, mask=live)
        tl.store(v_ptr + offs, v, mask=live)
        if WRITE_OUT:
            if MASK_OUT:  # the 2:4 GEMMs' operand is W ⊙ M
                tl.store(out_ptr + offs, (p * keep).to(out_ptr.dtype.element_ty), mask=live)
            else:
                tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=live)


def masked_adamw_(
    p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, mask: torch.Tensor,
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decay: float,
    out: torch.Tensor | None = None, mask_out: bool = False,
) -> None:  # fmt: skip
    """The Triton step (GPU, or under TRITON_INTERPRET): fp32 p, g, moments (contiguous); bool mask; ``out`` (any
    float dtype, p's shape, contiguous) receives the updated weights, times the mask with ``mask_out`` (the 2:4
    GEMMs' bf16 operand W ⊙ M)."""
    n = p.numel()
    if n == 0:
        return
    _masked_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p, g, exp_avg, exp_avg_sq, mask.view(torch.uint8), p if out is None else out, n,
        lr, beta1, beta2, eps, 1.0 - lr * weight_decay, decay, lr / (1 - beta1**step), math.sqrt(1 - beta2**step),
        WRITE_OUT=out is not None, MASK_OUT=mask_out, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip


class FusedMaskedAdamW:
    """Steps the sparse weights of a replicated, fused ``torch.optim.AdamW`` with ``masked_adamw_``, and hides
    them from the torch step (their ``.grad`` is None while it runs; ``restore`` puts it back); or, under the
    distributed optimizer, this rank's pieces of them (the optimizer leaves pieces it lent out of its own step).

    Only where it is exact and possible: fp32 masters on CUDA with a fused torch AdamW (or the distributed one), a
    sparse phase of the recipe, and gradients in ``.grad`` (in the distributed optimizer's buckets). Host step
    counts are read from the optimizer state once (after a load), or are the distributed optimizer's own host
    count, so a step does not synchronise. Either way the step claims the recipe's decay for this step
    (``SparsityManager.claim_decay``), so the decay cannot also be added to the gradients."""

    reference_off_gpu = False
    """Tests: step a distributed optimizer's pieces off the GPU too, through ``masked_adamw_reference``, so the
    piece bookkeeping runs on the CPU (on CUDA the Triton kernel always steps them)."""

    def __init__(self, manager, gemms: dict[str, object]) -> None:
        self.manager, self.gemms = manager, gemms
        self.names = {id(p): name for name, p in manager.weights.items()}  # the weights are fixed for a run
        self.steps: dict[str, int] | None = None
        self.hidden: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    @staticmethod
    def usable(optimizer) -> bool:
        return (
            triton is not None
            and isinstance(optimizer, torch.optim.AdamW)
            and bool(optimizer.defaults.get("fused"))
            and not optimizer.defaults.get("amsgrad")
            and not optimizer.defaults.get("maximize")
        )

    def reset(self) -> None:
        """Forget the host step counts (a checkpoint load replaced the optimizer state)."""
        self.steps = None

    def step(self, optimizer) -> bool:
        """Step every sparse weight (True), or leave all to the caller (False: not applicable this step)."""
        mgr = self.manager
        if not mgr.sparse:
            return False
        if hasattr(optimizer, "take_pieces"):
            return self._step_pieces(optimizer)
        if not self.usable(optimizer):
            return False
        todo = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self.names.get(id(p))
                if name is None or p.grad is None:
                    continue
                if p.dtype != torch.float32 or not p.is_cuda or not p.is_contiguous() or not p.grad.is_contiguous():
                    return False
                out = getattr(self.gemms.get(name), "_w", None)  # the GEMMs' W ⊙ M, written by the kernel
                if out is not None and not (out.shape == p.shape and out.is_contiguous()):
                    out = None
                todo.append((name, p, group, out))
        if not todo:
            return False
        mgr.claim_decay()
        if self.steps is None:  # once per run and after a load: one read of the device step counts
            state = optimizer.state
            self.steps = {n: int(state[p]["step"]) if "step" in state[p] else 0 for n, p, _, _ in todo}
        for name, p, group, out in todo:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.steps[name] = self.steps.get(name, 0) + 1
            beta1, beta2 = group["betas"]
            masked_adamw_(
                p.detach(), p.grad, st["exp_avg"], st["exp_avg_sq"], mgr.masks[name], self.steps[name],
                float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], mgr.cfg.decay,
                out=out, mask_out=True,
            )  # fmt: skip
            if out is not None:
                self.gemms[name].copy_written(mgr.masks[name])
            self.hidden.append((p, p.grad))
            p.grad = None  # the torch step skips it
        torch._foreach_add_([optimizer.state[p]["step"] for _, p, _, _ in todo], 1.0)
        return True

    def _step_pieces(self, optimizer) -> bool:
        """This DP rank's pieces of the sparse weights: decay + AdamW in one pass over the fp32 master, gradient and
        moment pieces and the mask's flat slice. The all-gather after the optimizer's step writes the parameters."""
        mgr = self.manager
        groups_ok = all(not g.get("amsgrad") and not g.get("maximize") for g in optimizer.param_groups)
        on_gpu = triton is not None and all(w.is_cuda for w in mgr.weights.values())
        if not groups_ok or not (on_gpu or self.reference_off_gpu):
            return False
        mgr.claim_decay()
        pieces, step = optimizer.take_pieces(lambda p: id(p) in self.names)
        for pc in pieces:
            name = self.names[id(pc.param)]
            beta1, beta2 = pc.group["betas"]
            adamw = masked_adamw_ if pc.master.is_cuda else masked_adamw_reference
            adamw(
                pc.master, pc.grad, pc.exp_avg, pc.exp_avg_sq, mgr.masks[name].view(-1)[pc.start : pc.end], step,
                float(pc.group["lr"]), beta1, beta2, pc.group["eps"], pc.group["weight_decay"], mgr.cfg.decay,
            )  # fmt: skip
        return True

    def restore(self) -> None:
        for p, g in self.hidden:
            p.grad = g
        self.hidden.clear()
