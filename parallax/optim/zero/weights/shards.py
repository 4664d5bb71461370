"""ZeRO-3 weights: each bucket's parameters sharded over dp, whole only while gathered.

A :class:`ShardedStore` holds, per bucket of a
:class:`~parallax.optim.zero.buffers.packing.FlatLayout`, this rank's chunk (``shards[b]``,
persistent) and the full bucket (``fulls[b]``), whose storage exists only between
:meth:`~ShardedStore.gather` and :meth:`~ShardedStore.release`. Every parameter's ``.data`` is a
view of its bucket's full tensor, so it keeps its shape, dtype and attributes (``tp_shard``) while
released, and autograd's saved references to it read the gathered values again once the bucket is
gathered for the backward (the storage is resized, not replaced). The all-gather writes through a
second tensor on the same storage with a version counter of its own, so re-gathering a weight saved
for the backward is not an in-place change of that weight to autograd.

At dp = 1 nothing is sharded: the chunk is the bucket, always there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallax import comm
from parallax.comm import Group
from parallax.optim.zero.buffers.packing import FlatLayout


def _alias(full: torch.Tensor) -> torch.Tensor:
    """A tensor on ``full``'s storage with its own autograd version counter."""
    out = torch.empty(0, dtype=full.dtype, device=full.device)
    return out.set_(full.untyped_storage(), full.storage_offset(), full.shape)


class ShardedStore:
    """The sharded weights of ``params`` laid out as ``layout`` (see the module docstring)."""

    @torch.no_grad()
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FlatLayout,
        dp_rank: int,
        device: torch.device,
    ) -> None:
        self.layout, self.dp_rank = layout, dp_rank
        self.sharded = layout.dp > 1
        self.fulls: list[torch.Tensor] = []  # (bucket,) each
        self.shards: list[torch.Tensor] = []  # (bucket/dp,) each
        self._targets: list[torch.Tensor] = []  # what the all-gather writes through
        self.gathered = [True] * len(layout.buckets)
        for b in layout.buckets:  # one bucket at a time: the peak stays near the model's size
            full = torch.zeros(b.numel, dtype=layout.dtypes[b.buffer], device=device)
            for i in b.params:
                slot, p = layout.slots[i], params[i]
                view = full[slot.offset - b.start : slot.offset - b.start + slot.numel]
                view = view.view(p.shape)
                view.copy_(p.detach())
                p.data = view
            mine = full[dp_rank * b.chunk : (dp_rank + 1) * b.chunk]
            self.fulls.append(full)
            self.shards.append(mine.clone() if self.sharded else mine)
            self._targets.append(_alias(full))
            self.release(b.index)

    def nbytes(self, b: int) -> int:
        return self.fulls[b].numel() * self.fulls[b].element_size()

    def gather(self, b: int, group: Group, async_op: bool = False) -> comm.Work:
        """Make bucket ``b`` whole (a collective over ``group``, the dp group); returns the
        handle to wait on when ``async_op``."""
        if self.gathered[b]:
            return None
        self.fulls[b].untyped_storage().resize_(self.nbytes(b))
        self.gathered[b] = True
        return comm.all_gather_into(self._targets[b], self.shards[b], group, async_op=async_op)

    def release(self, b: int) -> None:
        """Free bucket ``b``'s full storage (no-op when not sharded)."""
        if self.sharded and self.gathered[b]:
            self.fulls[b].untyped_storage().resize_(0)
            self.gathered[b] = False

    @torch.no_grad()
    def materialize(self, b: int) -> None:
        """Allocate bucket ``b`` without communicating: only this rank's chunk holds values
        (for loading, which then writes whole parameters into it and :meth:`commit` s)."""
        if self.gathered[b]:
            return
        self.fulls[b].untyped_storage().resize_(self.nbytes(b))
        self.gathered[b] = True
        self.own(b).copy_(self.shards[b])

    @torch.no_grad()
    def commit(self, b: int) -> None:
        """Keep what was written into gathered bucket ``b``: its own chunk into the shard."""
        if self.sharded:
            self.shards[b].copy_(self.own(b))

    def own(self, b: int) -> torch.Tensor:
        """This rank's chunk of the full bucket ``b`` (valid while it is gathered)."""
        chunk = self.layout.buckets[b].chunk
        return self._targets[b][self.dp_rank * chunk : (self.dp_rank + 1) * chunk]

    @torch.no_grad()
    def param_value(self, i: int, group: Group) -> torch.Tensor:
        """Parameter ``i``'s values on this tp rank, whole (a collective over ``group``: each
        dp rank adds the part it holds; one parameter, never its whole bucket, is made)."""
        slot = self.layout.slots[i]
        b = self.layout.buckets[slot.bucket]
        out = torch.zeros(slot.numel, dtype=self.fulls[b.index].dtype, device=self.shards[0].device)
        lo = b.start + self.dp_rank * b.chunk  # this rank's chunk in buffer coordinates
        a, z = max(lo, slot.offset), min(lo + b.chunk, slot.offset + slot.numel)
        if a < z:
            out[a - slot.offset : z - slot.offset] = self.shards[b.index][a - lo : z - lo]
        if self.sharded:
            comm.all_reduce(out, group)  # each element is held by exactly one dp rank
        return out

    def gathered_bytes(self) -> int:
        return sum(self.nbytes(b) for b, g in enumerate(self.gathered) if g and self.sharded)

    def shard_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)
