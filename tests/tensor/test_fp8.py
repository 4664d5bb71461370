"""FP8 compute on the CPU (``--fp8``'s GEMMs emulated): the rowwise scales and the saturating
casts against a float reference, the emulated GEMM against torch's own ``_scaled_mm`` (where
this torch runs it on a CPU) and against its contract, and the linear's autograd function
against fp32 products of the same FP8-rounded operands.

Tolerances: the FP8 GEMMs write bf16, so a result equal to the fp32 product of the rounded
operands is within bf16's half-ulp (2^-9 relative); ``RTOL = 2^-8`` leaves room for the
products' summation order. Against the unrounded product the error is FP8's own."""

import pytest
import torch
from torch.testing import assert_close

from parallax.tensor.fp8 import (
    E4M3,
    E5M2,
    cast_rows,
    dequantize,
    emulated_mm,
    fmax,
    fp8_linear,
    row_scales,
    saturate,
    scaled_mm,
    unit_roundoff,
)

RTOL = 2.0**-8
FORMATS = [E4M3, E5M2]


def _rows(seed: int, rows: int = 8, cols: int = 32) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 to 1e3), one of them zero."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    t[1] = 0.0
    return t


@pytest.mark.parametrize("dtype", FORMATS)
def test_row_scales_are_the_smallest_power_of_two_that_fits(dtype):
    t = _rows(0)
    s = row_scales(t, dtype)  # (rows, 1)
    assert s.shape == (8, 1) and s.dtype == torch.float32
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    amax = t.abs().amax(1, keepdim=True)
    live = amax.squeeze(1) > 0
    assert (amax / s <= fmax(dtype))[live].all()
    assert (amax / s > fmax(dtype) / 2)[live].all()  # the smallest such power
    assert torch.isfinite(s).all() and s[1].item() > 0  # a zero row keeps a finite scale


@pytest.mark.parametrize("dtype", FORMATS)
def test_casts_saturate_at_the_formats_max(dtype):
    m = fmax(dtype)
    t = torch.tensor([[-1e9, -m * 1.5, -m, 0.0, m, m * 1.5, 1e9]])
    assert torch.equal(saturate(t, dtype).float(), t.clamp(-m, m))
    if dtype == E5M2:  # torch's own cast overflows to inf there
        assert not torch.isfinite(t.to(dtype).float()).all()


@pytest.mark.parametrize("dtype", FORMATS)
def test_round_trip_is_within_the_formats_rounding(dtype):
    """Each value comes back within half a step: ``u |t|`` in the normal range, half the
    smallest subnormal (times the row's scale) below it."""
    t = _rows(1, rows=16, cols=64)
    codes, scale = cast_rows(t, dtype)
    assert codes.dtype == dtype and codes.is_contiguous()
    back = dequantize(codes, scale)
    info = torch.finfo(dtype)
    floor = info.tiny * info.eps / 2 * scale  # (rows, 1)
    err = (back - t).abs()
    assert (err <= unit_roundoff(dtype) * t.abs() + floor).all()
    assert err.max() > 0  # it did round


def _operands(m=24, k=32, n=48, seed=2):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    (aa, sa), (bb, sb) = cast_rows(a, E4M3), cast_rows(b, E4M3)
    return aa, bb.t(), sa, sb.t()  # (m, k) row-major, (k, n) column-major, (m, 1), (1, n)


def test_the_emulation_is_the_fp32_product_of_the_dequantized_operands():
    a, b, sa, sb = _operands()
    got = scaled_mm(a, b, sa, sb)  # on the CPU: emulated
    assert got.dtype == torch.bfloat16 and got.shape == (24, 48)
    ref = (dequantize(a, sa).double() @ dequantize(b, sb).double()).float()
    assert_close(got.float(), ref, rtol=RTOL, atol=1e-6)


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(
    _TORCH < (2, 13), reason="torch's CPU _scaled_mm with rowwise scales is checked on 2.13 (CI's)"
)
def test_the_emulation_equals_torchs_scaled_mm_on_the_cpu():
    a, b, sa, sb = _operands(m=20)
    real = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    real = real[0] if isinstance(real, tuple) else real
    assert_close(emulated_mm(a, b, sa, sb).float(), real.float(), rtol=RTOL, atol=1e-6)


def test_the_gpus_contract_is_checked_everywhere():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="row-major x column-major"):
        scaled_mm(a, b.contiguous(), sa, sb)  # a row-major second operand
    with pytest.raises(ValueError, match="FP8 x e4m3"):
        scaled_mm(a, b.to(E5M2), sa, sb)  # e5m2 is a first operand only
    with pytest.raises(ValueError, match="multiples of 16"):
        c, sc = cast_rows(torch.randn(24, 24), E4M3)
        d, sd = cast_rows(torch.randn(48, 24), E4M3)
        scaled_mm(c, d.t(), sc, sd.t())
    with pytest.raises(ValueError, match="scales"):
        scaled_mm(a, b, sa.t(), sb)


def _q(t: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """``t`` (rows, cols) as the GEMM sees it: rounded to ``dtype`` with its rows' scales."""
    return dequantize(*cast_rows(t, dtype))


@pytest.mark.parametrize("grad_format", FORMATS)
@pytest.mark.parametrize("rows", [16, 21])  # 21 tokens: the weight gradient pads to 32
def test_the_function_and_both_gradients_equal_fp32_on_the_rounded_operands(grad_format, rows):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 32, generator=g).requires_grad_(True)
    w = (torch.randn(48, 32, generator=g) * 0.1).requires_grad_(True)
    up = torch.randn(rows, 48, generator=g)
    y = fp8_linear(x.view(1, rows, 32), w, grad_format)  # (1, rows, 48)
    y.backward(up.view(1, rows, 48))
    assert y.dtype == x.dtype and x.grad.shape == x.shape and w.grad.shape == w.shape
    xd, wd = x.detach(), w.detach()
    # each GEMM scales along what it keeps: rows of x and W; rows of g, columns of W; columns
    # of g and of x
    fwd = _q(xd) @ _q(wd).t()
    dx = _q(up, grad_format) @ _q(wd.t()).t()
    dw = _q(up.t(), grad_format) @ _q(xd.t()).t()
    assert_close(y.detach().view(rows, 48), fwd, rtol=RTOL, atol=1e-6)
    assert_close(x.grad, dx, rtol=RTOL, atol=1e-6)
    assert_close(w.grad, dw, rtol=RTOL, atol=1e-6)
    # and near the exact products: FP8's rounding of both operands (a few % of the norm)
    bound = 3 * unit_roundoff(grad_format) + 2 * unit_roundoff(E4M3)
    for got, exact in ((fwd, xd @ wd.t()), (dx, up @ wd), (dw, up.t() @ xd)):
        assert (got - exact).norm() <= bound * exact.norm()


def test_a_frozen_weight_gets_no_gradient_and_bf16_stays_bf16():
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad is None


def test_what_a_gpu_needs_is_said(monkeypatch):
    """A CPU needs nothing (the emulation); an old torch or GPU is named in the message."""
    from parallax.tensor.fp8 import gemm

    assert gemm.support_problem(torch.device("cpu")) is None
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(gemm.torch, "__version__", "2.4.1")
    assert "torch >= 2.5" in gemm.support_problem(cuda) and "2.4.1" in gemm.support_problem(cuda)
    monkeypatch.setattr(gemm.torch, "__version__", "2.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA A100")
    assert "NVIDIA A100 has 8.0" in gemm.support_problem(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    assert gemm.support_problem(cuda) is None
