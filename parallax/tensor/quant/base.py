"""``--quantize-base``: every frozen linear of a chunk held quantized, one layer at a time.

A LoRA run's base is frozen; its column- and row-parallel linears (all but the output head,
which stays as it is, as QLoRA keeps it) are replaced by their quantized codes in module
order. Each layer's weight is quantized on the run's device and freed before the next, so a
chunk read on the host reaches the device already quantized: a rank never holds its bf16
shard on the device, and never any other rank's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.quant.weight import is_quantized, quantize_layer


@dataclass
class QuantReport:
    """What :func:`quantize_base` did on this rank."""

    kind: str
    layers: int = 0
    weights: int = 0  # elements now held quantized
    freed: int = 0  # bytes


def frozen_linears(model: nn.Module, exclude: Sequence[str]) -> Iterator[tuple[str, nn.Module]]:
    """The linears whose weight is frozen, not quantized yet, and not an excluded head."""
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if is_quantized(module) or name.rsplit(".", 1)[-1] in exclude:
            continue
        if not module.weight.requires_grad:
            yield name, module


@torch.no_grad()
def quantize_base(
    model: nn.Module,
    kind: str,
    device: torch.device | str | None = None,
    exclude: Sequence[str] = ("lm_head",),
) -> QuantReport:
    """Quantize every frozen linear of ``model`` (see the module docstring) as ``kind`` on
    ``device`` (default: where each weight is); the rest of the model stays where it is."""
    report = QuantReport(kind)
    for _, layer in list(frozen_linears(model, exclude)):
        report.weights += layer.weight.numel()
        report.freed += quantize_layer(layer, kind, device)
        report.layers += 1
    return report


def quantized_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(weight name, its QuantizedWeight)`` of every quantized layer, in module order: the
    names a checkpoint or an export gives the weights they stand for."""
    for name, module in model.named_modules():
        if is_quantized(module):
            yield (f"{name}.weight" if name else "weight"), module.quantized
