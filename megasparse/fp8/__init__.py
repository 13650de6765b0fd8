"""fp8 training: the fp8 GEMMs of the block linears (``gemm.py``), their cast/amax kernels (``cast.py``) and the
converter that installs them (``converter.py``, ``train.fp8``). Decision 1000."""

from megasparse.fp8.cast import E4M3, E5M2, pow2_scale, quantize, quantize_reference
from megasparse.fp8.converter import Fp8Converter, fp8_converter
from megasparse.fp8.gemm import Fp8Gemm, emulated_mm, scaled_mm

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8Converter",
    "Fp8Gemm",
    "emulated_mm",
    "fp8_converter",
    "pow2_scale",
    "quantize",
    "quantize_reference",
    "scaled_mm",
]
