"""FP8 compute for the parallel linears (``--fp8``): the formats and rowwise scaling
(:mod:`.cast`), the one scaled GEMM, real on a GPU and emulated elsewhere (:mod:`.gemm`), and a
linear's three GEMMs as an autograd function (:mod:`.linear`). The model-wide pass that turns
it on is :mod:`parallax.tensor.fp8_apply`."""

from parallax.tensor.fp8.cast import (
    ALIGN,
    E4M3,
    E5M2,
    FORMATS,
    cast_rows,
    dequantize,
    fits,
    fmax,
    row_scales,
    saturate,
    unit_roundoff,
)
from parallax.tensor.fp8.gemm import emulated_mm, scaled_mm, support_problem
from parallax.tensor.fp8.linear import GRAD_FORMAT, fp8_linear

__all__ = [
    "ALIGN",
    "E4M3",
    "E5M2",
    "FORMATS",
    "GRAD_FORMAT",
    "cast_rows",
    "dequantize",
    "emulated_mm",
    "fits",
    "fmax",
    "fp8_linear",
    "row_scales",
    "saturate",
    "scaled_mm",
    "support_problem",
    "unit_roundoff",
]
