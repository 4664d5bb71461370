"""Module parameters to and from checkpoints as full logical tensors, at any tp size.

A tp-sharded parameter (one with ``param.tp_shard``) is gathered over the tp group before it
is written and sliced back to this rank's piece when read, so a model saved at tp 2 loads at
tp 1 or 4. Names are ``prefix + parameter name``: give a pipeline stage the prefix (or the
module names) that makes them the whole model's names, as ``parallax.init_parameters`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from parallax.checkpoint.reader import Checkpoint
from parallax.checkpoint.stream import CheckpointError, TensorSource
from parallax.comm import Group
from parallax.tensor.sharding import TPShard, full_tensor, logical_shape, shard_tensor


def _named(
    module: nn.Module, prefix: str, only: Callable[[str], bool] | None = None
) -> list[tuple[str, nn.Parameter]]:
    named = module.named_parameters(prefix=prefix.rstrip("."))
    return [(n, p) for n, p in named if only is None or only(n)]


def module_sources(
    module: nn.Module,
    tp_group: Group,
    *,
    write: bool,
    prefix: str = "",
    only: Callable[[str], bool] | None = None,
) -> list[TensorSource]:
    """Sources for every parameter of ``module`` as full logical tensors.

    Every rank of ``tp_group`` must list them (the sharded ones are gathered, a collective);
    exactly one rank per set of replicas passes ``write=True``, typically ``tp_rank == 0`` of
    ``dp_rank == 0`` of each pipeline stage. Tp groups of other dp ranks hold the same values and
    can pass nothing at all. ``only``: a predicate on names, the parameters to write (a LoRA
    run writes only what trains).
    """
    out = []
    for name, param in _named(module, prefix, only):
        out.append(
            TensorSource(
                name,
                logical_shape(param),
                param.dtype,
                lambda p=param: full_tensor(p, tp_group),
                write=write,
            )
        )
    return out


@torch.no_grad()
def load_module(
    module: nn.Module,
    ckpt: Checkpoint,
    *,
    prefix: str = "",
    only: Callable[[str], bool] | None = None,
) -> None:
    """Copy this rank's piece of every parameter of ``module`` (those ``only`` selects) from
    ``ckpt`` (cast to the parameter's dtype). Shapes are checked for all parameters before any
    is overwritten."""
    named = _named(module, prefix, only)
    ckpt.require(name for name, _ in named)
    for name, param in named:
        if ckpt.shape(name) != logical_shape(param):
            raise CheckpointError(
                f"tensor {name!r}: checkpoint has shape {list(ckpt.shape(name))}, the model "
                f"expects {list(logical_shape(param))}"
            )
    for name, param in named:
        info: TPShard | None = getattr(param, "tp_shard", None)
        if info is None:
            value = ckpt.get(name)
        elif info.partitions == 1 and info.padded_size == info.full_size:
            start, stop = info.ranges()[0]
            dim = info.dim % param.dim()
            value = ckpt.get(name, (slice(None),) * dim + (slice(start, stop),))  # only my part
        else:
            value = shard_tensor(ckpt.get(name), info)
        param.copy_(value.to(param.dtype))
