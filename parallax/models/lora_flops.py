"""Model FLOPs of a LoRA training step: what the frozen base costs, and what it does not.

Convention (2 FLOPs per multiply-add; the model FLOPs that MFU divides by, not the hardware's:
activation recomputation is not counted). For a weight of ``N`` entries applied to ``T`` tokens:

    forward                      2 N T
    input gradient (backward)    2 N T   when its input needs a gradient
    weight gradient (backward)   2 N T   when the weight trains

A frozen weight never gets its weight-gradient product (autograd skips it: see the counting
test), and its input gradient is needed only when something trainable lies upstream of it (read
off one forward pass, :func:`linear_costs`): the first ``qkv`` of a frozen tower reads frozen
patch embeddings, so it costs its forward alone. An adapter of a linear ``(out, in)``: A
``(g r, in)`` trains and needs its input gradient as the base does; B ``(out, r)`` trains and
always passes a gradient back to A. So a LoRA'd decoder costs about ``4 x params x tokens`` per
step (plus ``6 x`` the adapters' ``(g r in + r out) T``) where full fine-tuning costs ``6 x``.
Attention products (no weights) cost 1x forward, 3x when their inputs need gradients (causal
attention counts half the score square, as :mod:`parallax.train.flops` does); the patch
convolution is a weight like any other (pixels never need gradients). Counted: linear and
convolution weights and attention products; biases, norms and element-wise work are left out
(under 0.1% of a 7B model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.lora import adapter_numel, is_lora_layer


@dataclass(frozen=True)
class LinearCost:
    """One linear layer's step cost per token (``per_token() x tokens``)."""

    name: str
    weight: int  # base matrix entries (logical)
    adapter_a: int  # adapter entries of A (g r in), 0 without an adapter
    adapter_b: int  # of B (out r)
    trained: bool  # the base weight trains
    input_grad: bool  # its input needs a gradient
    output_grad: bool  # its output does (what follows it runs a backward)

    def per_token(self) -> int:
        base = 2 * self.weight * (1 + int(self.input_grad) + int(self.trained))
        a = 2 * self.adapter_a * (2 + int(self.input_grad))
        return base + a + 6 * self.adapter_b


def linear_costs(model: nn.Module, *inputs) -> list[LinearCost]:
    """Every column-/row-parallel linear of ``model`` (plain or with an adapter) with its
    logical sizes and whether its input and output need gradients, found by running
    ``model(*inputs)`` once and looking (build the whole model at tp=1 on the meta device, with
    meta inputs, to cost a sharded run for nothing: no values are computed). Which inputs need
    gradients follows from the data flow (q, k and v read the same input; a frozen tower's
    first ``qkv`` reads frozen embeddings), not from the module order."""
    seen: dict[str, tuple[bool, bool]] = {}
    hooks = []

    def record(name):
        def hook(module, args, out):
            seen[name] = (args[0].requires_grad, out.requires_grad)

        return hook

    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            hooks.append(m.register_forward_hook(record(name)))
    try:
        with torch.enable_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for name, m in model.named_modules():
        if name not in seen:
            continue
        a = b = 0
        if is_lora_layer(m):
            b = m.lora_rank * m.out_features
            a = adapter_numel(m) - b
        w = m.in_features * m.out_features
        trained = m.quantized is None and m.weight.requires_grad  # a quantized base is frozen
        out.append(LinearCost(name, w, a, b, trained, *seen[name]))
    return out


def step_flops(costs: Sequence[LinearCost], tokens: Callable[[str], int]) -> float:
    """Sum of ``per_token() x tokens(name)`` over the linears."""
    return float(sum(c.per_token() * tokens(c.name) for c in costs))
