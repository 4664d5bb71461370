"""FP8 formats and the rowwise scaling that puts a tensor into one, as pure functions.

A tensor ``t`` (rows, cols) goes to FP8 one row at a time: the row's largest magnitude (its
amax) decides a dequantization scale ``s = 2^ceil(log2(amax / fmax))``, the smallest power of
two that brings the row within the format's largest finite value ``fmax``; the codes are
``t / s`` rounded to the format, saturated at +-fmax (torch's cast does not promise it: past the
range, e5m2 overflows to inf). Powers of two keep the division exact, so
the only rounding is the format's own (torchao's rowwise recipe rounds its scales the same way).
``codes * s`` is the value a GEMM sees: :func:`torch._scaled_mm` takes ``s`` as ``scale_a``
(rows, 1) of its first operand and ``scale_b`` (1, cols) of its second.

e4m3 (3 mantissa bits, fmax 448) carries activations and weights; gradients take e4m3 too by
default (as torchao's rowwise recipe does: per-row scales leave little need for e5m2's wider
range, and the rowwise kernels take e4m3 as the second operand only) or e5m2 (2 mantissa bits,
fmax 57344). Round to nearest keeps every code within half a step of its value: a relative
error of at most ``2^-4`` (e4m3) or ``2^-3`` (e5m2) for values in the normal range.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
ALIGN = 16  # torch._scaled_mm: the inner and the output dimension are multiples of 16
EPS = 1e-12  # the amax of an all-zero row (its scale stays finite)


def fmax(dtype: torch.dtype) -> float:
    """The largest finite value of FP8 format ``dtype``."""
    return float(torch.finfo(dtype).max)


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative error of round-to-nearest into ``dtype`` (normal range)."""
    return 2.0 ** -(MANTISSA_BITS[dtype] + 1)


def row_scales(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's dequantization scale for ``dtype``: (rows, cols) -> (rows, 1) fp32, powers of
    two with ``amax / scale <= fmax``."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp_min(EPS)  # (rows, 1)
    return torch.exp2(torch.ceil(torch.log2(amax / fmax(dtype))))


def saturate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (any float) cast to ``dtype``, clamped to its finite range first."""
    m = fmax(dtype)
    return t.clamp(-m, m).to(dtype)


def cast_rows(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, cols) as row-major FP8 codes (rows, cols) and their scales (rows, 1): the
    first operand of a scaled GEMM as it is, the second once transposed (column-major)."""
    scale = row_scales(t, dtype)  # (rows, 1)
    codes = saturate(t.float() / scale, dtype)  # (rows, cols)
    return codes.contiguous(), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values FP8 ``codes`` with their ``scale`` stand for."""
    return codes.float() * scale


def fits(rows: int, cols: int) -> bool:
    """Whether a weight of (rows, cols) can run through :func:`torch._scaled_mm` (both its
    dimensions are the GEMMs' inner or output dimension in one direction or another)."""
    return rows % ALIGN == 0 and cols % ALIGN == 0
