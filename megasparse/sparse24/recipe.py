"""The sparse-training recipe around the FFN weights: masks, masked decay, refresh cadence,
flip rate, dense fine-tuning and checkpointable state.

The trainer drives it through ``converter.py`` (``Sparse24Converter``); the step protocol (one optimizer step):

    loss.backward()                      # sparse24_linear with manager.state(name)
    manager.apply_masked_decay()         # before the optimizer (a sharded one: apply_masked_decay(its owned_range))
    optimizer.step()
    metrics.update(manager.after_step(step))   # step = number of completed optimizer steps
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megasparse.sparse24.config import SparsityConfig
from megasparse.sparse24.decay import masked_decay_
from megasparse.sparse24.linear import Sparse24Weight
from megasparse.sparse24.masks import check_cusparselt_shape, check_mask_shape, transposable_mask


class SparsityManager:
    """One Sparse24Weight per FFN weight (shard) whose 2:4 GEMMs run; each TP shard computes its own mask on its own
    shard.

    ``named_weights`` are the local tensors of the sparse linears (fc1 column-parallel [2f/tp, h], fc2
    row-parallel [h, f/tp]). Flip rate of a layer at a mask refresh: the fraction of its mask entries that
    differ from the mask installed at the previous refresh, |M_new − M_old|₁ / numel, i.e. the paper's r_t
    measured over ``refresh_interval`` optimizer steps (equal to the paper's per-step r_t when the interval
    is 1). ``after_step`` also reports ``all``: the element-weighted rate over every sparse weight.
    """

    def __init__(self, named_weights: dict[str, torch.nn.Parameter], cfg: SparsityConfig, total_steps: int):
        cfg.validate()
        self.cfg = cfg
        self.weights = dict(named_weights)
        self.total_steps = int(total_steps)
        self.switch_step = int(round(self.total_steps * (1.0 - cfg.dense_finetune_fraction)))
        """First completed-step count at which training runs dense."""
        self.step = 0
        self.updates = 0
        """Optimizer steps and loads seen: the key of the operand copies (a fused optimizer moves no versions)."""
        self.dense = False
        self.decayed = False
        """This step's masked decay was applied (into the gradients, or inside a fused step): ``claim_decay``."""
        self.masks: dict[str, torch.Tensor] = {}
        self._states: dict[str, Sparse24Weight] = {}
        for name, w in self.weights.items():
            check_mask_shape(w.shape, name)
            self.masks[name] = transposable_mask(w.detach())
            if not cfg.monitor_only:
                backend = cfg.backend
                if backend == "cusparselt" and w.dtype not in (torch.bfloat16, torch.float16):
                    # fp32 master weights: the trainer's Sparse24Gemm compresses the bf16 compute copy, so only
                    # the shape rules apply here and this state holds the masks (masked dense in fp32)
                    check_cusparselt_shape(w.shape, name)
                    backend = "emulate"
                self._states[name] = Sparse24Weight(w, self.masks[name], backend=backend, name=name)
        if self.switch_step <= 0:
            self._go_dense()

    # -- queries ---------------------------------------------------------------------------------------------------
    def state(self, name: str) -> Sparse24Weight | None:
        """The layer's Sparse24Weight, or None when it runs dense (fine-tuning phase or monitor-only) or another GEMM
        runs it (``release``)."""
        return None if self.dense else self._states.get(name)

    def release(self, name: str) -> None:
        """Another GEMM runs ``name``'s layer (fp8's, over W ⊙ M): its Sparse24Weight goes, so its cuSPARSELt operands
        are never built or refreshed (decision 1235); its mask, decay, refresh and dense switch stay here."""
        self._states.pop(name, None)

    @property
    def sparse(self) -> bool:
        return not self.dense and not self.cfg.monitor_only

    # -- per step --------------------------------------------------------------------------------------------------
    def claim_decay(self) -> None:
        """Called by whatever applies this step's masked decay (``apply_masked_decay``, or a fused optimizer step that
        decays in registers): a second claim before ``after_step`` would decay twice, and raises."""
        if self.decayed:
            raise RuntimeError("sparsity: the masked decay was already applied for this optimizer step")
        self.decayed = True

    @torch.no_grad()
    def apply_masked_decay(self, owned: Callable[[torch.nn.Parameter], tuple[int, int]] | None = None) -> None:
        """grad += λ·(¬M ⊙ W) for every sparse weight (into ``main_grad`` when the optimizer uses one).

        ``owned(w)``: the [start, end) of w's flattened elements whose gradient the optimizer step reads (a
        distributed optimizer's own chunk, ``DistributedAdamW.owned_range``); the decay touches only those, since
        the rest of the gradient is never read. None: whole tensors."""
        if not self.sparse or self.cfg.decay == 0.0:
            return
        self.claim_decay()
        for name, w in self.weights.items():
            g = getattr(w, "main_grad", None)
            if g is None:
                if w.grad is None:
                    w.grad = torch.zeros_like(w)
                g = w.grad
            lo, hi = (0, w.numel()) if owned is None else owned(w)
            if lo < hi:  # flat views (``view`` refuses to copy: the decay must land in the gradient itself)
                flat = slice(lo, hi)
                masked_decay_(
                    g.view(-1)[flat], w.detach().view(-1)[flat], self.masks[name].view(-1)[flat], self.cfg.decay
                )

    @torch.no_grad()
    def after_step(self, step: int) -> dict[str, float]:
        """Call after optimizer step number ``step`` (1-based). Returns flip rates on mask-refresh steps, else {}."""
        self.step = int(step)
        self.updates += 1
        self.decayed = False
        if self.dense:
            return {}
        if self.step >= self.switch_step:
            self._go_dense()
            return {}
        if self.step % self.cfg.refresh_interval == 0:
            return self._refresh_masks()
        for name, st in self._states.items():
            st.refresh(self.weights[name], force=True)  # the optimizer may not have moved the version
        return {}

    def _refresh_masks(self) -> dict[str, float]:
        rates: dict[str, float] = {}
        flipped = total = 0
        for name, w in self.weights.items():
            new = transposable_mask(w.detach())
            diff = int((new != self.masks[name]).sum())
            rates[name] = diff / new.numel()
            flipped += diff
            total += new.numel()
            self.masks[name] = new
            st = self._states.get(name)
            if st is not None:
                st.set_mask(new)
                st.refresh(w)
        rates["all"] = flipped / max(total, 1)
        return rates

    def _go_dense(self) -> None:
        self.dense = True
        self._states.clear()

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "dense": self.dense,
            "masks": {k: v.detach().cpu().clone() for k, v in self.masks.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.updates += 1
        missing = set(self.weights) - set(sd["masks"])
        if missing:
            raise KeyError(f"sparsity state has no mask for {sorted(missing)}")
        for name, w in self.weights.items():
            m = sd["masks"][name].to(device=w.device, dtype=torch.bool)
            if tuple(m.shape) != tuple(w.shape):
                raise ValueError(f"sparsity: saved mask for {name} is {list(m.shape)}, weight is {list(w.shape)}")
            self.masks[name] = m
            st = self._states.get(name)
            if st is not None:
                st.set_mask(m)
                st.refresh(w)
        if sd["dense"]:
            self._go_dense()
