"""A linear held whole on every tp rank whose output feeds tp-split consumers.

Multi-query attention's single key/value head (pi0's Gemma streams) cannot be split over tp:
each rank's query heads read the whole key. The projection is then replicated, and its output
enters the tp region through :func:`~parallax.tensor.functional.copy_to_tp` (identity forward,
sum over tp backward): each rank's queries give the key their own share of its gradient, the
sum makes the gradient reaching the projection whole and the same on every rank, so its
weights' (and a LoRA adapter's, :mod:`parallax.tensor.lora`) gradients are whole too and need
no further sum. The parameters carry no ``tp_shard``: every reader of the model takes them as
replicated (written once, counted once in the gradient norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.tensor.functional import copy_to_tp
from parallax.tensor.tp import TPLike, resolve_tp


class ReplicatedLinear(nn.Linear):
    """``y = x W^T + b`` on every tp rank, entering the tp region (module doc)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        ctx: TPLike,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.group, self.tp_rank, self.tp_size = resolve_tp(ctx)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` (a LoRA kind adds its adapter's product here)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(self._product(x), self.group)  # (..., out), whole on every rank
