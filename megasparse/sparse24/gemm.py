"""The 2:4 sparse GEMMs behind a tensor-parallel linear layer (fc1 / fc2 of a sparse FFN).

``ColumnParallelLinear`` / ``RowParallelLinear`` call ``gemm.fwd / dgrad / wgrad`` on rows; this adapter routes
those through the layer's ``Sparse24Weight`` while the recipe says the layer is sparse, and through plain dense
GEMMs otherwise (dense fine-tuning, monitor-only). Parameters are fp32 masters while compute may be bf16: the
sparse operands are then built from a bf16 copy made once per optimizer step (not per micro-batch), with the
mask the recipe owns. The backward works on whatever rows it is given, so token filtering's compact rows pass
straight through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megasparse.ops.wgrad import accumulate_mm
from megasparse.sparse24.linear import Sparse24Weight, sparse24_backward, sparse24_forward
from megasparse.sparse24.recipe import SparsityManager

if TYPE_CHECKING:
    from megasparse.fp8.gemm import Fp8Gemm


class Sparse24Gemm:
    def __init__(
        self, manager: SparsityManager, name: str, param: torch.nn.Parameter, compute_dtype: torch.dtype, mvue: bool
    ):
        self.manager, self.name, self.param, self.dtype, self.mvue = manager, name, param, compute_dtype, mvue
        self._w: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._written_at: int | None = None
        self._w_mask: torch.Tensor | None = None  # the mask the compute copy was multiplied by (None: plain copy)
        self._state: Sparse24Weight | None = None
        self._mask = None
        self.use_sparse = True
        """False: masked dense GEMMs (the converter's step-level autotune found them faster)."""
        self._fp8: Fp8Gemm | None = None

    @property
    def fp8(self) -> Fp8Gemm | None:
        """With ``train.fp8`` on, the fp8 GEMM (``fp8/converter.py``) that runs this layer's three GEMMs as dense fp8
        over W ⊙ M, quantised from ``weight_and_mask()``: dense fp8 beats 2:4 on Hopper (decision 1001)."""
        return self._fp8

    @fp8.setter
    def fp8(self, gemm: Fp8Gemm | None) -> None:
        # The one rule (decision 1235): once fp8 runs a layer's GEMMs, no 2:4 operand is built, refreshed or kept for
        # it (no cuSPARSELt values / metadata, no W ⊙ M), so the manager drops its Sparse24Weight and the autotune has
        # nothing to time (``tunable``). Masks, masked decay, mask refresh, dense fine-tune and checkpoints stay.
        self._fp8 = gemm
        if gemm is not None:
            self.manager.release(self.name)
            self._state = None

    @property
    def tunable(self) -> bool:
        """Whether the autotune's switch (``use_sparse``) changes this layer's GEMMs: it runs 2:4 GEMMs now (not the
        dense phase, not monitor-only, not fp8's)."""
        return self.manager.state(self.name) is not None

    def _copy_mask(self) -> torch.Tensor | None:
        """The mask the compute copy carries: the current one while the layer runs sparse, None when it runs dense."""
        return self.manager.masks[self.name] if self.manager.sparse else None

    def _copy(self) -> torch.Tensor:
        """The weight in compute dtype, copied again after each optimizer step: a fused optimizer writes the master
        without moving its version counter, so the recipe's step count is part of the key. While the layer runs
        sparse the copy is W ⊙ M itself (the masked-dense GEMMs read it as is, the packing reads its kept values),
        so no separate W ⊙ M is made or stored. When the fused 2:4 step (``optim.py``) already wrote the new
        masked values here with the current mask, only the operands built from them are stale; after a mask
        refresh or the switch to dense the copy is made again from the master."""
        key = (self.param._version, self.manager.updates)
        mask = self._copy_mask()
        if self._w is None:
            self._w = torch.empty(self.param.shape, dtype=self.dtype, device=self.param.device)
            self._fill(mask)
        elif self._key != key or self._w_mask is not mask:
            if self._written_at == self.param._version and self._w_mask is mask:
                if self._state is not None:
                    self._state.invalidate()
            else:
                self._fill(mask)
            self._written_at = None
        self._key = key
        return self._w

    def _fill(self, mask: torch.Tensor | None) -> None:
        # in place: a captured step keeps reading this buffer
        if mask is None:
            self._w.copy_(self.param.detach())
        else:
            torch.mul(self.param.detach(), mask, out=self._w)
        self._w_mask = mask

    def copy_written(self, mask: torch.Tensor) -> None:
        """The optimizer just wrote the updated weight, times ``mask``, into the compute copy (``optim.py``)."""
        self._written_at = self.param._version
        self._w_mask = mask

    def weight_and_mask(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, M) whose product W ⊙ M is the weight the GEMMs compute with (M None: W itself), for fp8's casts, which
        read both and make no product. Parameters in the compute dtype (bf16 under the distributed optimizer): the
        parameter and the mask (None in the dense phase). fp32 masters: the compute copy, already W ⊙ M (the fused
        2:4 step writes it in the pass that updates W: the casts then read 2 bytes an element, not 4 + 1)."""
        if self.param.dtype != self.dtype:
            return self._copy(), None
        return self.param.detach(), self._copy_mask()

    def operand(self) -> torch.Tensor | None:
        """The layer's compute-dtype weight (the layer casts nothing per micro-batch); None when no cast is needed."""
        if self.fp8 is not None:
            return self.fp8.operand()
        return None if self.param.dtype == self.dtype else self._copy()

    def _operands(self) -> tuple[Sparse24Weight | None, torch.Tensor | None]:
        st = self.manager.state(self.name)
        if st is None:
            return None, None
        if self.param.dtype == self.dtype:
            st.use_sparse = self.use_sparse  # the manager's own state: the autotune's switch reaches it too
            return st, self.param
        wt = self._copy()
        mask = self.manager.masks[self.name]
        if self._state is None:
            self._state = Sparse24Weight(wt, mask, backend=self.manager.cfg.backend, name=self.name)
            self._state.source_masked = True  # _copy's W ⊙ M
        elif self._mask is not mask:
            self._state.set_mask(mask)
        self._mask = mask
        self._state.use_sparse = self.use_sparse
        return self._state, wt

    def prepare_replay(self) -> tuple:
        """Bring the operands up to date on the host, as a forward would (a replayed CUDA graph runs none of this
        code), and name the buffers the GEMMs read: when the key changes, the graph must be captured again."""

        def at(t: torch.Tensor | None) -> int | None:  # storage, not the Python object: aliases are made per refresh
            return None if t is None else t.data_ptr()

        if self.fp8 is not None:  # the fp8 copies are refreshed in place after each step (fp8/converter.py)
            return (self.name, "fp8", at(self.fp8.w8), at(self.fp8.w8t))
        st, wt = self._operands()
        if st is None:  # dense phase or monitor-only: the graph reads the plain copy, which nothing else refreshes
            return (self.name, None, at(self.operand()))
        st.refresh(wt)
        return (self.name, self.use_sparse, st.mask_version, at(st.packed), at(st.packed_t), at(st._masked), at(wt))

    def fwd(self, x2d: torch.Tensor, w: torch.Tensor, for_wgrad: bool = False) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.fwd(x2d, w, for_wgrad)
        st, wt = self._operands()
        return x2d @ w.t() if st is None else sparse24_forward(x2d, wt, st)

    def dgrad(self, g2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.dgrad(g2d, w)
        st, wt = self._operands()
        if st is None:
            return g2d @ w
        return sparse24_backward(g2d, None, wt, st, self.mvue, need_input_grad=True, need_weight_grad=False)[0]

    def take_saved_input(self) -> tuple[torch.Tensor, ...] | None:
        """fp8's e4m3 input for the weight gradient (``Fp8Gemm.take_saved_input``); nothing without fp8."""
        return None if self.fp8 is None else self.fp8.take_saved_input()

    def wgrad_input(self, saved: tuple[torch.Tensor, ...], idx: torch.Tensor | None = None):
        """fp8's weight-gradient operand from ``take_saved_input`` (only fp8 keeps one)."""
        return self.fp8.wgrad_input(saved, idx)

    def take_x_amax(self) -> torch.Tensor | None:
        """fp8's kept input amax (``Fp8Gemm.take_x_amax``); nothing without fp8."""
        return None if self.fp8 is None else self.fp8.take_x_amax()

    def wgrad_into(
        self, g2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, x_amax: torch.Tensor | None = None
    ) -> bool:
        """Straight-through: the dense weight gradient, added into ``out``; MVUE's sparse estimate returns instead."""
        if self.fp8 is not None:
            return self.fp8.wgrad_into(g2d, x2d, out, x_amax)
        if self.mvue and self.manager.state(self.name) is not None:
            return False
        accumulate_mm(out, g2d.t(), x2d)
        return True

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.wgrad(g2d, x2d, x_amax)
        st, wt = self._operands()
        if st is None or not self.mvue:
            return g2d.t() @ x2d  # straight-through: the dense weight gets the dense gradient
        return sparse24_backward(g2d, x2d, wt, st, True, need_input_grad=False, need_weight_grad=True)[1]
