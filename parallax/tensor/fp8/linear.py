"""``x W^T`` with all three GEMMs of a linear in FP8, as an autograd function.

Each GEMM scales its operands along the dimensions it keeps (:func:`~.cast.cast_rows` of the
operand, or of its transpose), never along the one it sums over:

=============  =======================  ==========================  =========================
GEMM           first operand            second (column-major)       scales
=============  =======================  ==========================  =========================
y = x W^T      x (M, in), e4m3          W^T (in, out), e4m3         x's rows, W's rows
dx = g W       g (M, out), grad format  W (out, in), e4m3           g's rows, W's columns
dW = g^T x     g^T (out, M), grad fmt   x (M, in), e4m3             g's columns, x's columns
=============  =======================  ==========================  =========================

So W is cast twice (by rows for the forward, by columns for the input gradient) and the
gradient twice; the forward keeps ``x`` as it came (what a bf16 linear keeps) and casts it
again by columns for the weight gradient. The weight gradient's inner dimension is the token
count M, which :func:`torch._scaled_mm` wants a multiple of 16: M is padded with zero rows
(they add nothing to the sum) when it is not. A frozen weight (LoRA's base) skips that GEMM.

Under tensor parallelism each rank scales its own shard: where a shard splits the dimension a
GEMM sums over (the row-parallel input in the forward, the column-parallel output in the input
gradient), each rank's part of a row gets its own scale, a finer scaling than one process's
(blockwise along that dimension, one block a rank). No collective, and the casts fuse into the
compiled block; the cost is that tp > 1 and tp = 1 agree within FP8's rounding, not bit for bit
(``tests/tensor/test_fp8.py`` checks both sides of that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallax.tensor.fp8.cast import ALIGN, E4M3, cast_rows
from parallax.tensor.fp8.gemm import scaled_mm

GRAD_FORMAT = E4M3  # see cast.py: torchao's rowwise recipe's choice


def _pad_inner(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, cols) with zero columns up to a multiple of 16 (the inner dimension of the
    weight gradient)."""
    extra = -t.shape[1] % ALIGN
    return t if extra == 0 else F.pad(t, (0, extra))


class _FP8Linear(torch.autograd.Function):
    """``x W^T`` (no bias), every GEMM in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, grad_format: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        xa, xs = cast_rows(x2, E4M3)  # (M, in), (M, 1)
        wa, ws = cast_rows(w, E4M3)  # (out, in), (out, 1)
        y = scaled_mm(xa, wa.t(), xs, ws.t(), fast_accum=True)  # (M, out)
        ctx.save_for_backward(x, w)
        ctx.grad_format = grad_format
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # (M, out)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            ga, gs = cast_rows(g, ctx.grad_format)  # (M, out), (M, 1)
            wt, wts = cast_rows(w.t(), E4M3)  # (in, out) by W's columns, (in, 1)
            dx = scaled_mm(ga, wt.t(), gs, wts.t())  # (M, in)
            dx = dx.to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # (M, in)
            gt, gts = cast_rows(_pad_inner(g.t()), ctx.grad_format)  # (out, Mp), (out, 1)
            xt, xts = cast_rows(_pad_inner(x2.t()), E4M3)  # (in, Mp), (in, 1)
            dw = scaled_mm(gt, xt.t(), gts, xts.t()).to(w.dtype)  # (out, in)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, grad_format: torch.dtype = GRAD_FORMAT):
    """``x W^T`` in FP8: (..., in) x (out, in) -> (..., out) in ``x``'s dtype. ``W``'s dims
    must be multiples of 16 (:func:`~.cast.fits`); the layers fall back to bf16 otherwise."""
    return _FP8Linear.apply(x, w, grad_format)
