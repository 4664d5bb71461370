"""A frozen linear weight held quantized on its layer, and its GEMM.

:func:`quantize_layer` replaces a column- or row-parallel layer's ``weight`` parameter by a
:class:`QuantizedWeight` (buffers: the codes and scales of :mod:`.formats`), keeping the
weight's ``tp_shard``. The layer's product then runs :class:`_DequantLinear`: the weight is
dequantized in the input's dtype for the GEMM and dropped, and dequantized again in the
backward for the input's gradient. Saving it for the backward instead would keep a bf16 copy of
every quantized layer alive from its forward to its backward: the whole base again.

The quantized weight is a buffer, not a parameter: it never trains, and ZeRO neither reduces nor
shards it (at stage 3 every dp rank holds the quantized base whole; the planner counts it so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax import comm
from parallax.tensor.quant.formats import (
    Packed,
    dequantize_parts,
    empty_packed,
    nf4_levels,
    quantize,
)
from parallax.tensor.sharding import TPShard


class _DequantLinear(torch.autograd.Function):
    """``x W^T`` with ``W`` rebuilt from its codes in each direction (no weight gradient)."""

    @staticmethod
    def forward(ctx, x, codes, scales, factor, levels, kind: str, shape: tuple[int, int]):
        w = dequantize_parts(kind, shape, codes, scales, factor, levels, x.dtype)  # (out, in)
        ctx.save_for_backward(codes, scales, factor, levels)
        ctx.kind, ctx.shape, ctx.dtype = kind, shape, x.dtype
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.saved_tensors
        w = dequantize_parts(ctx.kind, ctx.shape, *parts, ctx.dtype)
        return grad @ w, None, None, None, None, None, None  # (..., in)


class QuantizedWeight(nn.Module):
    """A layer's frozen weight as codes and scales (see :mod:`.formats`)."""

    def __init__(self, packed: Packed, info: TPShard | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.shape, self.dtype = packed.kind, packed.shape, dtype
        self.tp_shard = info  # how the weight it stands for is split over tp
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        # int8 keeps no factor; an empty buffer keeps the autograd function's arguments tensors
        factor = packed.factor if packed.factor is not None else packed.scales.new_zeros(0)
        self.register_buffer("factor", factor.float())
        levels = nf4_levels(packed.codes.device) if self.kind == "nf4" else factor.new_zeros(0)
        self.register_buffer("levels", levels, persistent=False)

    def _parts(self) -> tuple:
        nf4 = self.kind == "nf4"
        return (self.codes, self.scales, *((self.factor, self.levels) if nf4 else (None, None)))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T``: (..., in) -> (..., out) on this rank."""
        return _DequantLinear.apply(x, *self._parts(), self.kind, self.shape)

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight this stands for on this rank, (out, in), in ``dtype`` (default: the dtype
        it was quantized from)."""
        return dequantize_parts(self.kind, self.shape, *self._parts(), dtype or self.dtype)

    def numel(self) -> int:
        """Elements of the weight it stands for (on this rank)."""
        return self.shape[0] * self.shape[1]

    def placeholder(self) -> torch.Tensor:
        """A meta tensor of the weight's shape and dtype on this rank, with its ``tp_shard``:
        what an export lists (its value comes from :meth:`dequantize`)."""
        t = torch.empty(self.shape, dtype=self.dtype, device="meta")
        if self.tp_shard is not None:
            t.tp_shard = self.tp_shard
        return t

    def nbytes(self) -> int:
        """The bytes it holds (NF4's 64-byte table of levels left out)."""
        held = (b for n, b in self.named_buffers() if n != "levels")
        return sum(b.numel() * b.element_size() for b in held)

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={self.shape}, {self.nbytes() / 2**20:.1f} MiB"


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(getattr(layer, "quantized", None), QuantizedWeight)


@torch.no_grad()
def quantize_layer(layer: nn.Module, kind: str, device: torch.device | str | None = None) -> int:
    """Replace ``layer.weight`` (frozen) by its ``kind`` codes on ``device`` (default: where it
    is), in place; returns the bytes freed. A row-parallel layer agrees each row's factor over
    its tp group (a collective: every tp rank quantizes the same layers in the same order)."""
    w = layer.weight
    if w.requires_grad:
        raise ValueError("only a frozen weight is quantized (it has requires_grad=True)")
    info: TPShard | None = getattr(w, "tp_shard", None)
    split_rows = info is not None and info.dim == 1 and layer.tp_size > 1

    def row_max(local: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(local, layer.group, op="max") if split_rows else local

    freed = w.numel() * w.element_size()
    if w.is_meta or torch.device(device or w.device).type == "meta":
        packed = empty_packed(kind, tuple(w.shape), "meta")  # shapes only
    else:
        packed = quantize(w.detach().to(device or w.device), kind, row_max)
    del layer.weight  # the parameter goes; its shard info stays on the quantized weight
    layer.quantized = QuantizedWeight(packed, info, w.dtype)
    return freed - layer.quantized.nbytes()
