"""How a tensor-parallel parameter relates to its full logical tensor.

Every sharded parameter carries a :class:`TPShard` as ``param.tp_shard``; a parameter without one
is replicated across the tp group. Everything that must see logical tensors (layout-free init,
checkpoints, Hugging Face loading, gradient-norm clipping) goes through this one description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallax import comm
from parallax.comm import Group


@dataclass(frozen=True)
class TPShard:
    """This rank's share of one tensor dimension.

    The logical dimension ``dim`` of size ``full_size`` is zero-padded to ``padded_size`` (a
    multiple of ``tp_size * partitions``), cut into ``partitions`` equal blocks (3 for a fused
    QKV weight, 2 for a fused gate/up weight), and each block is split into ``tp_size`` contiguous
    pieces; rank ``r`` holds piece ``r`` of every block, concatenated in block order.
    """

    dim: int
    full_size: int
    padded_size: int
    tp_rank: int
    tp_size: int
    partitions: int = 1

    @property
    def local_size(self) -> int:
        return self.padded_size // self.tp_size

    def ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of the padded logical dim that this rank holds, in order."""
        block = self.padded_size // self.partitions
        piece = block // self.tp_size
        return [
            (p * block + self.tp_rank * piece, p * block + (self.tp_rank + 1) * piece)
            for p in range(self.partitions)
        ]

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def make_shard(
    dim: int,
    full_size: int,
    tp_rank: int,
    tp_size: int,
    partitions: int = 1,
    pad: bool = False,
    what: str = "tensor",
) -> TPShard:
    """Describe a split, padding ``full_size`` up when ``pad`` and raising otherwise."""
    unit = tp_size * partitions
    if full_size % unit != 0 and not pad:
        raise ValueError(
            f"{what}: size {full_size} is not divisible by tp={tp_size}"
            + (f" x {partitions} fused blocks" if partitions > 1 else "")
            + f"; choose a tp that divides {full_size // partitions}"
        )
    if pad and partitions != 1:
        raise ValueError(f"{what}: padding is only supported without fused blocks")
    padded = -(-full_size // unit) * unit
    return TPShard(dim, full_size, padded, tp_rank, tp_size, partitions)


def shard_tensor(full: torch.Tensor, info: TPShard) -> torch.Tensor:
    """This rank's piece of a full logical tensor (zero padding included)."""
    dim = info.dim % full.dim()
    if full.shape[dim] != info.full_size:
        raise ValueError(
            f"shard_tensor: dim {dim} has size {full.shape[dim]}, expected {info.full_size}"
        )
    pad = info.padded_size - info.full_size
    if pad:
        spec = [0, 0] * (full.dim() - 1 - dim) + [0, pad]
        full = F.pad(full, spec)
    pieces = [full.narrow(dim, start, stop - start) for start, stop in info.ranges()]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].clone()


def unshard_tensor(local: torch.Tensor, info: TPShard, group: Group) -> torch.Tensor:
    """Gather every rank's piece back into the full logical tensor (padding removed)."""
    dim = info.dim % local.dim()
    gathered = comm.all_gather(local.contiguous(), group, dim=dim)  # rank-major pieces
    if info.partitions > 1:
        piece = info.local_size // info.partitions
        chunks = gathered.split(piece, dim=dim)  # ordered (rank, partition)
        order = [
            r * info.partitions + p for p in range(info.partitions) for r in range(info.tp_size)
        ]
        gathered = torch.cat([chunks[i] for i in order], dim=dim)
    return gathered.narrow(dim, 0, info.full_size).contiguous()


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the full logical tensor that ``param`` is (a piece of)."""
    info: TPShard | None = getattr(param, "tp_shard", None)
    return tuple(param.shape) if info is None else info.full_shape(tuple(param.shape))


def full_tensor(param: torch.Tensor, group: Group) -> torch.Tensor:
    """The full logical value of a (possibly tp-sharded) parameter, on every tp rank."""
    info: TPShard | None = getattr(param, "tp_shard", None)
    return param.detach().clone() if info is None else unshard_tensor(param.detach(), info, group)
