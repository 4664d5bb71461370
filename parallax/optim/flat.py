"""The tensors behind a :class:`~parallax.optim.buckets.FlatLayout` on one rank.

One parameter buffer and one gradient buffer per dtype; every trainable parameter's ``.data``
and ``.grad`` become views into them, so the all-gather writes straight into the model and the
reduce-scatter reads straight from the gradients. For each bucket, this rank's fp32 master chunk
and the fp32 chunk its reduced gradient lands in: for fp32 buckets these are the rank's own
chunks of the two buffers (in-place collectives, no copies); for other dtypes, separate fp32
slices. The wrapped optimizer steps *pieces*: views of those chunks, one per parameter part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallax import comm
from parallax.comm import Group
from parallax.optim.buckets import FlatLayout, Piece


class FlatBuffers:
    @torch.no_grad()
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FlatLayout,
        dp_rank: int,
        device: torch.device,
    ) -> None:
        self.params, self.layout, self.dp_rank = params, layout, dp_rank
        sizes = list(zip(layout.dtypes, layout.sizes))
        self.param_buffers = [torch.zeros(n, dtype=dt, device=device) for dt, n in sizes]
        self.grad_buffers = [torch.zeros(n, dtype=dt, device=device) for dt, n in sizes]
        self.grad_views: list[torch.Tensor] = []
        for p, slot in zip(params, layout.slots):
            span = slice(slot.offset, slot.offset + slot.numel)
            view = self.param_buffers[slot.buffer][span].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            grad = self.grad_buffers[slot.buffer][span].view(p.shape)
            if p.grad is not None:
                grad.copy_(p.grad)
            p.grad = grad
            self.grad_views.append(grad)

        separate = sum(b.chunk for b in layout.buckets if layout.dtypes[b.buffer] != torch.float32)
        self.master_flat = torch.zeros(separate, device=device) if separate else None
        self.grad_shard_flat = torch.zeros(separate, device=device) if separate else None
        self.masters: list[torch.Tensor] = []  # per bucket: this rank's fp32 master chunk
        self.grad_outs: list[torch.Tensor] = []  # per bucket: where its reduced chunk lands
        offset = 0
        for b in layout.buckets:
            mine, grad = self.own_chunk(b.index, self.param_buffers), None
            if mine.dtype == torch.float32:
                master, grad = mine, self.own_chunk(b.index, self.grad_buffers)
            else:
                master = self.master_flat[offset : offset + b.chunk]
                master.copy_(mine)
                grad = self.grad_shard_flat[offset : offset + b.chunk]
                offset += b.chunk
            self.masters.append(master)
            self.grad_outs.append(grad)

        self.pieces: list[Piece] = layout.pieces(dp_rank)
        self.piece_params = [self._piece(self.masters, pc) for pc in self.pieces]
        self.piece_grads = [self._piece(self.grad_outs, pc) for pc in self.pieces]
        self.pieces_of: list[list[tuple[Piece, torch.Tensor]]] = [[] for _ in params]
        for pc, t in zip(self.pieces, self.piece_params):
            self.pieces_of[pc.param].append((pc, t))

    @staticmethod
    def _piece(chunks: list[torch.Tensor], pc: Piece) -> torch.Tensor:
        return chunks[pc.bucket][pc.chunk_offset : pc.chunk_offset + pc.numel]

    def own_chunk(self, b: int, buffers: list[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` in ``buffers`` (the parameter or gradient ones)."""
        bucket = self.layout.buckets[b]
        lo = bucket.chunk_start(self.dp_rank)
        return buffers[bucket.buffer][lo : lo + bucket.chunk]

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the parameters' current values into the separate fp32 masters."""
        for b, master in enumerate(self.masters):
            mine = self.own_chunk(b, self.param_buffers)
            if master.data_ptr() != mine.data_ptr():
                master.copy_(mine)

    @torch.no_grad()
    def gather_params(self, group: Group, changed: Sequence[bool]) -> None:
        """Write the masters into the model and all-gather every bucket with a ``changed``
        parameter (``changed`` must be the same on every rank of ``group``)."""
        works = []
        for b, (bucket, master) in enumerate(zip(self.layout.buckets, self.masters)):
            if not any(changed[i] for i in bucket.params):
                continue
            mine = self.own_chunk(b, self.param_buffers)  # (bucket/dp,)
            if master.data_ptr() != mine.data_ptr():
                mine.copy_(master)  # fp32 -> the model's dtype
            full = self.param_buffers[bucket.buffer][bucket.start : bucket.end]  # (bucket,)
            works.append(comm.all_gather_into(full, mine, group, async_op=True))
        for work in works:
            comm.wait(work)
