"""The one scaled FP8 GEMM every FP8 product runs through: :func:`torch._scaled_mm` on a GPU,
its emulation elsewhere (the same codes and scales, multiplied in fp32), so the scaling and
casting code around it runs, and is tested, on a CPU.

The contract is torch's rowwise one, checked here on every device so that a CPU test catches
what the GPU would refuse: ``a`` (M, K) row-major FP8, ``b`` (K, N) column-major e4m3 (the
rowwise kernels take e5m2 as the first operand only), K and N multiples of 16, ``scale_a``
(M, 1) and ``scale_b`` (1, N) fp32, a bf16 result. ``out = (a * scale_a) @ (b * scale_b)``.
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from parallax.tensor.fp8.cast import ALIGN, E4M3, E5M2, dequantize

MIN_TORCH = "2.5"  # rowwise scales (scale_a (M, 1)) in torch._scaled_mm
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
OUT_DTYPE = torch.bfloat16  # what the rowwise kernels write


def support_problem(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on ``device`` with this torch (None: they can). A CPU runs the
    emulation (tests); a GPU needs CUDA (not ROCm), torch >= 2.5 and capability >= 8.9."""
    if device.type != "cuda":
        return None
    if torch.version.hip:
        return "--fp8 runs on NVIDIA GPUs only (ROCm's FP8 formats are the fnuz kinds)"
    have = TorchVersion(torch.__version__)
    if have < MIN_TORCH or not hasattr(torch, "_scaled_mm"):
        return f"--fp8 needs torch >= {MIN_TORCH} (rowwise-scaled torch._scaled_mm); this is {have}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"--fp8 needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper "
            f"or newer); {name} has {cap[0]}.{cap[1]}"
        )
    return None


def check_operands(a, b, scale_a, scale_b) -> None:
    """``ValueError`` unless the operands meet torch's rowwise contract (module docstring)."""
    m, k = a.shape
    k2, n = b.shape
    problems = []
    if k != k2:
        problems.append(f"inner dimensions differ ({k} and {k2})")
    if a.dtype not in (E4M3, E5M2) or b.dtype != E4M3:
        problems.append(f"dtypes {a.dtype} x {b.dtype} (want FP8 x e4m3)")
    if k % ALIGN or n % ALIGN:
        problems.append(f"K={k} and N={n} must be multiples of {ALIGN}")
    if a.stride(1) != 1 or b.stride(0) != 1:
        problems.append(f"layouts {a.stride()} x {b.stride()} (want row-major x column-major)")
    if tuple(scale_a.shape) != (m, 1) or tuple(scale_b.shape) != (1, n):
        problems.append(f"scales {tuple(scale_a.shape)} x {tuple(scale_b.shape)}")
    if problems:
        raise ValueError(f"scaled FP8 GEMM ({m}x{k} @ {k2}x{n}): " + "; ".join(problems))


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)``: (M, K) x (K, N) -> (M, N) bf16 (see the module
    docstring); emulated off the GPU."""
    check_operands(a, b, scale_a, scale_b)
    if a.device.type != "cuda":
        return emulated_mm(a, b, scale_a, scale_b)
    out = torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=OUT_DTYPE, use_fast_accum=fast_accum
    )
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 also returned the amax


def emulated_mm(a, b, scale_a, scale_b) -> torch.Tensor:
    """:func:`scaled_mm` in fp32 on the dequantized operands, rounded once to bf16."""
    return (dequantize(a, scale_a) @ dequantize(b, scale_b)).to(OUT_DTYPE)  # (M, N)
