"""Layout-free parameter initialisation.

The same seed gives the same logical weights whatever the layout: each parameter's full tensor
is drawn from a generator seeded by ``(seed, parameter name)``, then this rank keeps its tp
slice. One parameter at a time is materialised in full, so memory stays bounded by the largest
tensor. Values depend on the device type of the parameters (CPU and CUDA generators differ),
not on tp, pp or dp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from parallax.seeds import param_seed
from parallax.tensor.sharding import TPShard, logical_shape, shard_tensor

__all__ = ["InitFn", "default_init", "init_parameters", "param_seed"]

InitFn = Callable[[str, tuple[int, ...], torch.Generator, torch.device], torch.Tensor | None]


def default_init(std: float = 0.02) -> InitFn:
    """Normal(0, std) for tensors of two or more dims, zeros for biases, and 1-D tensors such as
    norm weights keep their module's constant initialisation (returned as ``None``)."""

    def init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if len(shape) < 2:
            return None
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return init


@torch.no_grad()
def init_parameters(
    module: nn.Module, seed: int, init_fn: InitFn | None = None, prefix: str = ""
) -> None:
    """Overwrite every parameter of ``module`` with its layout-free value.

    ``prefix`` is prepended to the names, so that a pipeline stage holding part of a model names
    its parameters as the whole model does.
    """
    init_fn = init_fn or default_init()
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        gen = torch.Generator(device=param.device).manual_seed(param_seed(seed, name))
        full = init_fn(name, logical_shape(param), gen, param.device)
        if full is None:
            continue
        info: TPShard | None = getattr(param, "tp_shard", None)
        param.copy_(full if info is None else shard_tensor(full, info))
