"""The quantized formats of a frozen base weight, as pure functions on one 2-D tensor.

Both keep every row apart, so a column-parallel shard (whole rows) quantizes as the whole weight
does, and a row-parallel shard whose width is a whole number of blocks does too, once the
per-row factors are agreed over tp (the ``row_max`` hook: a max over the tp group).

- **NF4** (QLoRA's 4-bit NormalFloat): each row is cut into blocks of 64 weights (the row padded
  with zeros to whole blocks); a block keeps the index of the nearest of 16 levels (the
  quantiles of a normal distribution scaled to [-1, 1]) for ``w / absmax``, two to a byte. The
  block absmaxes are themselves quantized ("double quantization"): 8 bits each, as a fraction
  of their row's largest absmax, kept in fp32. That is 4 + 8/64 + 32/in bits a weight, about
  0.52 bytes. Each weight is then within ``gap/2 * absmax + rowmax/510`` of its value, where
  ``gap`` is the widest step between adjacent levels (the first term NF4's rounding, the second
  the 8-bit absmax's).
- **int8**: symmetric, one fp32 scale per row (``rowmax / 127``): within ``scale / 2``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# QLoRA's NF4 data type (Dettmers et al. 2023, appendix E): its 16 values in increasing order.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_BLOCK = 64
NF4_WIDEST_GAP = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
KINDS = ("nf4", "int8")
RowMax = Callable[[torch.Tensor], torch.Tensor]  # (rows, 1) local max -> max over the shards


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Packed:
    """One quantized weight: ``codes`` and the scales that turn them back into values."""

    kind: str
    shape: tuple[int, int]  # the weight's (rows, cols) on this rank
    codes: torch.Tensor  # nf4: (rows, blocks * 32) uint8, two codes a byte; int8: (rows, cols)
    scales: torch.Tensor  # nf4: (rows, blocks) uint8 absmax codes; int8: (rows, 1) fp32
    factor: torch.Tensor | None  # nf4: (rows, 1) fp32, the row's largest absmax / 255

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.factor)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def bytes_per_weight(kind: str, cols: int) -> float:
    """What a weight of a row of ``cols`` costs stored as ``kind`` (codes and scales)."""
    if kind == "int8":
        return 1.0 + 4.0 / cols
    blocks = -(-cols // NF4_BLOCK)
    return (blocks * (NF4_BLOCK // 2) + blocks + 4) / cols


@torch.no_grad()
def quantize(w: torch.Tensor, kind: str, row_max: RowMax = _same) -> Packed:
    """``w`` (rows, cols), any float dtype, as ``kind``; ``row_max`` agrees each row's factor
    with the other shards of the row (identity for a whole row)."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantized format {kind!r}: one of {', '.join(KINDS)}")
    if w.dim() != 2:
        raise ValueError(f"a quantized weight is 2-D, got shape {tuple(w.shape)}")
    w = w.float()
    if kind == "int8":
        rmax = row_max(w.abs().amax(dim=1, keepdim=True))  # (rows, 1)
        scale = (rmax / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)  # (rows, cols)
        return Packed(kind, tuple(w.shape), codes, scale, None)
    return _quantize_nf4(w, row_max)


def _quantize_nf4(w: torch.Tensor, row_max: RowMax) -> Packed:
    rows, cols = w.shape
    blocks = -(-cols // NF4_BLOCK)
    padded = torch.nn.functional.pad(w, (0, blocks * NF4_BLOCK - cols))  # (rows, blocks*64)
    grouped = padded.view(rows, blocks, NF4_BLOCK)
    absmax = grouped.abs().amax(dim=2)  # (rows, blocks)
    rmax = row_max(absmax.amax(dim=1, keepdim=True))  # (rows, 1)
    factor = (rmax / 255.0).clamp_min(torch.finfo(torch.float32).tiny)
    scale_codes = torch.round(absmax / factor).clamp_(0, 255).to(torch.uint8)  # (rows, blocks)
    scale = scale_codes.float() * factor  # what dequantization will use
    normed = grouped / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    levels = torch.tensor(NF4_LEVELS, device=w.device)
    mids = (levels[1:] + levels[:-1]) / 2
    idx = torch.bucketize(normed.clamp(-1, 1), mids).to(torch.uint8).view(rows, -1)
    codes = (idx[:, 0::2] << 4) | idx[:, 1::2]  # (rows, blocks*32): high nibble first
    return Packed("nf4", (rows, cols), codes, scale_codes, factor)


def empty_packed(kind: str, shape: tuple[int, int], device) -> Packed:
    """The parts of a ``kind`` weight of ``shape``, uninitialised (on ``meta``: shapes only,
    for the planner's counts and ``--dry-run``)."""
    rows, cols = shape
    if kind == "int8":
        codes = torch.empty(rows, cols, dtype=torch.int8, device=device)
        return Packed(kind, shape, codes, torch.empty(rows, 1, device=device), None)
    blocks = -(-cols // NF4_BLOCK)
    codes = torch.empty(rows, blocks * NF4_BLOCK // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, blocks, dtype=torch.uint8, device=device)
    return Packed(kind, shape, codes, scales, torch.empty(rows, 1, device=device))


def nf4_levels(device) -> torch.Tensor:
    """The 16 NF4 values as a tensor (a quantized weight keeps one as a buffer: made per call,
    the copy to the GPU would stall the host at every layer)."""
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def dequantize(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``p`` stands for, (rows, cols) in ``dtype``."""
    levels = nf4_levels(p.codes.device) if p.kind == "nf4" else None
    return dequantize_parts(p.kind, p.shape, p.codes, p.scales, p.factor, levels, dtype)


def dequantize_parts(
    kind: str, shape, codes, scales, factor, levels, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize` on the parts (what the GEMM's autograd function holds); ``levels``:
    :func:`nf4_levels` on the codes' device (None for int8)."""
    rows, cols = shape
    if kind == "int8":
        return (codes.float() * scales).to(dtype)  # (rows, cols)
    idx = torch.stack((codes >> 4, codes & 15), dim=-1).view(rows, -1, NF4_BLOCK)
    scale = scales.float() * factor  # (rows, blocks)
    w = levels[idx.int()] * scale.unsqueeze(-1)  # (rows, blocks, 64)
    return w.view(rows, -1)[:, :cols].to(dtype)
