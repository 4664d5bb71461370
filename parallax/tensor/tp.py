"""What every tensor-parallel layer needs: the tp group from whatever names it, and parameters
that carry their shard (:class:`~parallax.tensor.sharding.TPShard`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from parallax import comm
from parallax.comm import Group
from parallax.context import ParallelContext
from parallax.tensor.sharding import TPShard

TPLike = ParallelContext | dist.ProcessGroup | None


def resolve_tp(ctx: TPLike) -> tuple[Group, int, int]:
    """``(group, tp_rank, tp_size)`` from a context, a bare group, or ``None``."""
    if ctx is None:
        return None, 0, 1
    if isinstance(ctx, ParallelContext):
        return ctx.tp_group, ctx.tp_rank, ctx.tp_size
    if isinstance(ctx, dist.ProcessGroup):
        return (ctx, comm.rank(ctx), comm.size(ctx)) if comm.size(ctx) > 1 else (None, 0, 1)
    raise TypeError(f"expected a ParallelContext, a ProcessGroup or None, got {type(ctx)!r}")


class TPLayer(nn.Module):
    """What every tensor-parallel layer holds: its tp group and place in it, and whether its
    activations outside the tp region are split along ``sequence_dim`` (sequence parallel)."""

    def __init__(self, ctx: TPLike, sequence_parallel: bool = False, sequence_dim: int = 1) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = resolve_tp(ctx)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim


def tp_param(shape: tuple[int, ...], info: TPShard | None, device, dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    if info is not None:
        p.tp_shard = info
    return p


# The layers' own draws. A layer built on meta (the planner's and a checkpoint load's shapes)
# has nothing to draw: these skip it, which also keeps torch's meta normal_ from importing
# torch._dynamo (1.5 s of every plan and dry run).
def uniform_(t: torch.Tensor, fan_in: int) -> None:
    if t.is_meta:
        return
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(t, -bound, bound)


def normal_(t: torch.Tensor) -> None:
    if not t.is_meta:
        nn.init.normal_(t)
