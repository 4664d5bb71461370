"""``--fp8``: every column- and row-parallel linear of a model computes in FP8, but the output
head.

The pass only marks layers (``layer.fp8 = True``); their weights, masters and optimizer state
stay as they are, and each product casts its operands per call (:mod:`parallax.tensor.fp8`). A
layer whose weight on this rank has a dimension that is not a multiple of 16 (what
:func:`torch._scaled_mm` takes) stays in bf16, and so does one held quantized
(``--quantize-base``, refused with ``--fp8`` by the run's rules). A LoRA layer's base product
runs in FP8 and its adapter in the model's dtype.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from parallax.tensor.fp8 import fits, support_problem
from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear


@dataclass
class FP8Report:
    """What :func:`enable_fp8` did on this rank."""

    layers: int = 0  # linears now in FP8
    fallback: list[tuple[str, tuple[int, int]]] = field(default_factory=list)  # (name, shape)

    def describe(self) -> str:
        """One line for the log: how many linears run in FP8 and which stay in bf16."""
        line = f"--fp8: {self.layers} linears in FP8"
        if not self.fallback:
            return line
        kinds: dict[str, tuple[int, int]] = {}
        for name, shape in self.fallback:  # blocks alike as one pattern
            kinds.setdefault(re.sub(r"\.\d+\.", ".*.", name), shape)
        shown = ", ".join(f"{n} {s[0]}x{s[1]}" for n, s in kinds.items())
        return (
            f"{line}; {len(self.fallback)} stay in bf16 (a weight dimension on this rank is not "
            f"a multiple of 16): {shown}"
        )


def enable_fp8(model: nn.Module, exclude: Sequence[str] = ("lm_head",)) -> FP8Report:
    """Mark every parallel linear of ``model`` whose shapes allow it to compute in FP8 (see the
    module docstring); ``exclude``: module names (their last part) left alone."""
    report = FP8Report()
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if name.rsplit(".", 1)[-1] in exclude:
            continue
        shape = module.local_shape
        if module.quantized is not None or not fits(*shape):
            report.fallback.append((name, shape))
            continue
        module.fp8 = True
        report.layers += 1
    return report


def check_fp8_device(device: torch.device | str) -> None:
    """``ValueError`` when ``device`` cannot run FP8 GEMMs with this torch (a CPU runs them
    emulated: tests only; the run's rules refuse ``--fp8`` there)."""
    problem = support_problem(torch.device(device))
    if problem:
        raise ValueError(problem)
