"""The 2:4 sparse GEMMs behind a tensor-parallel linear layer (fc1 / fc2 of a sparse FFN).

``ColumnParallelLinear`` / ``RowParallelLinear`` call ``gemm.fwd / dgrad / wgrad`` on rows; this adapter routes
those through the layer's ``Sparse24Weight`` while the recipe says the layer is sparse, and through plain dense
GEMMs otherwise (dense fine-tuning, monitor-only). Parameters are fp32 masters while compute may be bf16: the
sparse operands are then built from a bf16 copy made once per optimizer step (not per micro-batch), with the
mask the recipe owns. The backward works on whatever rows it is given, so token filtering's compact rows pass
straight through.
"""

from __future__ import annotations

import torch

from megasparse.ops.wgrad import accumulate_mm
from megasparse.sparse24.linear import Sparse24Weight, sparse24_backward, sparse24_forward
from megasparse.sparse24.recipe import SparsityManager


class Sparse24Gemm:
    def __init__(
        self, manager: SparsityManager, name: str, param: torch.nn.Parameter, compute_dtype: torch.dtype, mvue: bool
    ):
        self.manager, self.name, self.param, self.dtype, self.mvue = manager, name, param, compute_dtype, mvue
        self._w: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._written_at: int | None = None
        self._state: Sparse24Weight | None = None
        self._mask = None
        self.use_sparse = True
        """False: masked dense GEMMs (the converter's step-level autotune found them faster)."""

    def _copy(self) -> torch.Tensor:
        """The weight in compute dtype, copied again after each optimizer step: a fused optimizer writes the master
        without moving its version counter, so the recipe's step count is part of the key. When the fused 2:4
        step (``optim.py``) already wrote the new values here, only the operands built from them are stale."""
        key = (self.param._version, self.manager.updates)
        if self._w is None:
            self._w = self.param.detach().to(self.dtype)
        elif self._key != key:
            if self._written_at == self.param._version:
                if self._state is not None:
                    self._state.invalidate()
            else:
                self._w.copy_(self.param.detach())  # in place: a captured step keeps reading this buffer
            self._written_at = None
        self._key = key
        return self._w

    def copy_written(self) -> None:
        """The optimizer just wrote the updated weight into the compute copy (``optim.FusedMaskedAdamW``)."""
        self._written_at = self.param._version

    def operand(self) -> torch.Tensor | None:
        """The layer's compute-dtype weight (the layer casts nothing per micro-batch); None when no cast is needed."""
        return None if self.param.dtype == self.dtype else self._copy()

    def _operands(self) -> tuple[Sparse24Weight | None, torch.Tensor | None]:
        st = self.manager.state(self.name)
        if st is None:
            return None, None
        if self.param.dtype == self.dtype:
            return st, self.param
        wt = self._copy()
        mask = self.manager.masks[self.name]
        if self._state is None:
            self._state = Sparse24Weight(wt, mask, backend=self.manager.cfg.backend, name=self.name)
        elif self._mask is not mask:
            self._state.set_mask(mask)
        self._mask = mask
        self._state.use_sparse = self.use_sparse
        return self._state, wt

    def prepare_replay(self) -> tuple:
        """Bring the operands up to date on the host, as a forward would (a replayed CUDA graph runs none of this
        code), and name the buffers the GEMMs read: when the key changes, the graph must be captured again."""
        st, wt = self._operands()
        if st is None:
            return (self.name, None)
        st.refresh(wt)
        return (self.name, self.use_sparse, st.mask_version, id(st.packed), id(st.packed_t), id(st._masked), id(wt))

    def fwd(self, x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        st, wt = self._operands()
        return x2d @ w.t() if st is None else sparse24_forward(x2d, wt, st)

    def dgrad(self, g2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        st, wt = self._operands()
        if st is None:
            return g2d @ w
        return sparse24_backward(g2d, None, wt, st, self.mvue, need_input_grad=True, need_weight_grad=False)[0]

    def wgrad_into(self, g2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor) -> bool:
        """Straight-through: the dense weight gradient, added into ``out``; MVUE's sparse estimate returns instead."""
        if self.mvue and self.manager.state(self.name) is not None:
            return False
        accumulate_mm(out, g2d.t(), x2d)
        return True

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        st, wt = self._operands()
        if st is None or not self.mvue:
            return g2d.t() @ x2d  # straight-through: the dense weight gets the dense gradient
        return sparse24_backward(g2d, x2d, wt, st, True, need_input_grad=False, need_weight_grad=True)[1]
