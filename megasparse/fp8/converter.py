"""fp8 GEMMs as a model converter (``train.fp8``), the way the 2:4 converter plugs in.

    conv = fp8_converter(cfg, model)       # None when train.fp8=off; installs Fp8Gemm on qkv/proj/fc1/fc2
    ... optimizer step ...
    conv.post_optimizer_step()             # the fp8 weight copies from the new masters, in place

What stays in bf16: the output layer and the loss (``loss/``: CCE's logit GEMMs), the embeddings, and on CUDA the
linears whose GEMMs are too small for fp8 to pay for its casts (``train.fp8_min_mnk``, decision 1001). 2:4 fc1/fc2
run dense fp8 GEMMs on their masked weights W ⊙ M (on Hopper fp8 dense beats 2:4 in bf16 or fp8: decision 1001),
quantised from W and M without a product, and their 2:4 GEMM operands are never built (decision 1235).
Under tensor parallelism each TP shard scales its own operands: no amax all-reduce (decision 1000).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megasparse.fp8.gemm import Fp8Gemm, Recipe
from megasparse.parallel.layers import DENSE

__all__ = ["Fp8Converter", "fp8_converter", "fp8_from_config"]


SAVE_INPUTS = ("qkv", "fc1", "fc2")
"""Linears whose bf16 input only they keep (decision 1245): the norms' outputs, and the SwiGLU's unless selective
recompute rebuilds it from fc1's output (``fp8_from_config`` drops fc2 then). proj's input is the attention's
output, which the attention keeps for its own backward anyway: an e4m3 copy would add bytes, not save them."""


def _kind(name: str) -> str:
    """``layers.3.mlp.fc1.weight`` → ``fc1``."""
    return name.rsplit(".", 2)[-2]


def _log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class Fp8Converter:
    """Installs ``Fp8Gemm`` on a model's block linears and refreshes their fp8 weight copies after each step."""

    def __init__(
        self,
        recipe: Recipe,
        wgrad_fp8: bool = True,
        min_mnk: float = 0.0,
        rows: int = 0,
        save_inputs: tuple[str, ...] = SAVE_INPUTS,
        keep_transpose: bool = True,
    ) -> None:
        self.recipe, self.wgrad_fp8, self.keep_transpose = recipe, wgrad_fp8, keep_transpose
        self.save_inputs = save_inputs
        """The kinds of linear (``qkv``, ``fc1``, ...) that keep their input for the weight gradient as the forward's
        e4m3 transpose instead of in bf16 (decision 1245): those whose bf16 input nothing else keeps."""
        self.min_mnk, self.rows = min_mnk, rows
        """A CUDA linear runs fp8 when ``rows`` (its smallest GEMM's token rows) · out · in ≥ ``min_mnk``."""
        self.gemms: dict[str, Fp8Gemm] = {}
        self.skipped: dict[str, str] = {}
        """weight name → why it kept its GEMM."""
        self.on_2to4: list[str] = []
        """The 2:4 linears whose GEMMs fp8 took (their 2:4 GEMM operands are never built: decision 1235)."""

    def convert(self, model: torch.nn.Module) -> dict[str, Fp8Gemm]:
        """Every linear the model names (``model.linears()``: qkv, proj, fc1, fc2) that still runs the dense GEMM."""
        return self.convert_linears(model.linears())

    def convert_linears(self, linears: dict[str, torch.nn.Module]) -> dict[str, Fp8Gemm]:
        for name, lin in linears.items():
            n, k = lin.weight.shape
            masked = getattr(lin.gemm, "weight_and_mask", None)  # a 2:4 GEMM: fp8 over its W ⊙ M
            if lin.gemm is not DENSE and masked is None:
                self.skipped[name] = f"keeps its {type(lin.gemm).__name__}"
            elif lin.weight.is_cuda and (n % 16 or k % 16):
                self.skipped[name] = f"[{n}, {k}] is not a multiple of 16 (torch._scaled_mm)"
            elif lin.weight.is_cuda and self.rows * n * k < self.min_mnk:
                self.skipped[name] = f"GEMMs below train.fp8_min_mnk={self.min_mnk:.3g}"
            else:
                save = _kind(name) in self.save_inputs
                g = self.gemms[name] = Fp8Gemm(
                    lin.weight, self.recipe, self.wgrad_fp8, masked, save_input=save, keep_transpose=self.keep_transpose
                )
                if masked is not None:
                    lin.gemm.fp8 = g
                    self.on_2to4.append(name)
                else:
                    lin.gemm = g
        self.refresh()
        return self.gemms

    def refresh(self) -> None:
        """The fp8 copies from the current masters (after an optimizer step or a checkpoint load)."""
        for g in self.gemms.values():
            g.refresh()

    def post_optimizer_step(self) -> None:
        self.refresh()

    def capture_blocker(self) -> str | None:
        """None: the fp8 GEMMs capture (their weight copies are refreshed in place outside the graphs)."""
        return None

    def banner(self, device: torch.device) -> str:
        kinds = sorted({_kind(n) for n in self.gemms})
        how = (
            "torch._scaled_mm"
            if device.type == "cuda"
            else "emulated on CPU (exact fp8 rounding and scales, fp32 products: for tests, not speed)"
        )
        grads = f"e4m3 weights/activations, e5m2 gradients, weight gradient in {'fp8' if self.wgrad_fp8 else 'bf16'}"
        line = f"fp8: {self.recipe} scaling ({grads}) on {len(self.gemms)} GEMMs ({', '.join(kinds)}), {how}"
        saving = sorted({_kind(n) for n, g in self.gemms.items() if g.save_input})
        if saving:
            line += f"; {', '.join(saving)} keep their inputs in e4m3 for the weight gradient"
        if not self.keep_transpose:
            line += "; Wᵀ transposed at each backward (train.fp8_keep_transpose=false)"
        if self.on_2to4:
            line += (
                f"; the {len(self.on_2to4)} 2:4 ones on W ⊙ M from W and its mask (masks and recipe kept; no "
                "cuSPARSELt operands, nothing for the 2:4 GEMM autotune to choose)"
            )
        kept = sorted({why for why in self.skipped.values()})
        if kept:
            line += f"; {len(self.skipped)} linears unchanged ({'; '.join(kept)})"
        return line + "; output layer and loss in bf16"


def fp8_from_config(cfg) -> Fp8Converter | None:
    """The converter for ``train.fp8`` (None when off), not yet applied: the trainer converts after the 2:4 FFNs."""
    if cfg.train.fp8 == "off":
        return None
    f = cfg.filter
    kept = f.keep_ratio if f.mode == "collider" else 1.0
    rows = int(cfg.model.seq_length * cfg.train.micro_batch_size * kept)  # a TP region's GEMMs see the whole sequence
    save = SAVE_INPUTS if cfg.model.recompute != "selective" else tuple(k for k in SAVE_INPUTS if k != "fc2")
    return Fp8Converter(
        cfg.train.fp8,
        wgrad_fp8=cfg.train.fp8_wgrad,
        min_mnk=cfg.train.fp8_min_mnk,
        rows=rows,
        save_inputs=save,
        keep_transpose=cfg.train.fp8_keep_transpose,
    )


def fp8_converter(cfg, model: torch.nn.Module, device: torch.device) -> Fp8Converter | None:
    """The converter for ``train.fp8`` (None when off), applied to ``model``, with its one-line banner on rank 0."""
    conv = fp8_from_config(cfg)
    if conv is None:
        return None
    conv.convert(model)
    _log0(conv.banner(device))
    return conv
