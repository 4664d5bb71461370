"""The tensors behind a :class:`~parallax.optim.zero.buffers.packing.FlatLayout` on one rank.

One parameter buffer and one gradient buffer per dtype; every trainable parameter's ``.data`` and
``.grad`` become views into them, so the all-gather writes straight into the model and the
reduce-scatter reads straight from the gradients. For each bucket, this rank's fp32 master chunk and
the home of its fp32 reduced gradient (see :meth:`~parallax.optim.zero.stage.ZeroStage.grad_home`):
for fp32 buckets both are the rank's own chunks of the two buffers (in-place collectives, no
copies); for other dtypes the master is a separate fp32 slice, and the gradient a separate fp32
slice, an fp32 view over the bucket's own gradient bytes, or (dp=1) the staging buffer, filled
bucket by bucket when the optimizer steps. The wrapped optimizer steps *pieces*: views of those
chunks, one per parameter part.

At ZeRO-2 and 3 there is no gradient buffer (``.grad`` stays None; each backward pass's gradients go
to :class:`~parallax.optim.zero.reduction.pass_reducer.PassReducer`) and every bucket's reduced
gradient lives in the fp32 slice. At ZeRO-3 there is no parameter buffer either: a
:class:`~parallax.optim.zero.weights.shards.ShardedStore` holds this rank's chunk of each bucket,
and the model's weights only while gathered."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch

from parallax import comm
from parallax.comm import Group
from parallax.optim.zero.buffers.homes import INPLACE, SHARD, STAGED, check_homes
from parallax.optim.zero.buffers.master_halves import join, low_half
from parallax.optim.zero.buffers.packing import FlatLayout, Piece
from parallax.optim.zero.stage import ZeroStage
from parallax.optim.zero.weights.shards import ShardedStore

LOW_PAD = 8  # bytes before the first low half in each plane


class FlatBuffers:
    @torch.no_grad()
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FlatLayout,
        dp_rank: int,
        device: torch.device,
        homes: Sequence[str],
        stage: ZeroStage = ZeroStage.SHARD_STATE,
        offload: Collection[int] = (),
        split: Collection[int] = (),
    ) -> None:
        check_homes(layout, homes, stage)
        self.params, self.layout, self.dp_rank, self.homes = params, layout, dp_rank, homes
        self.stage = stage
        self.store = ShardedStore(params, layout, dp_rank, device) if stage.shards_weights else None
        self._model_views(device)
        self.offload = set(offload)  # buckets whose masters live in host memory
        # offloaded bf16 buckets whose masters the host keeps as low halves (master_halves)
        self.split = set(split)
        if not self.split <= self.offload:
            raise ValueError("only offloaded buckets can keep their masters split")
        self.lows: dict[int, torch.Tensor] = {}  # split bucket -> its masters' low halves
        self._allocate_chunks(device)
        self.masters: list[torch.Tensor] = []  # per bucket: this rank's fp32 master chunk
        self.grad_outs: list[torch.Tensor | None] = []  # per bucket: where its reduced chunk lands
        self._place_chunks()
        self.pieces: list[Piece] = layout.pieces(dp_rank)
        self.piece_params = [self._piece(self.masters, pc) for pc in self.pieces]
        self.piece_grads = [  # None for pieces of staged buckets
            None if self.grad_outs[pc.bucket] is None else self._piece(self.grad_outs, pc)
            for pc in self.pieces
        ]
        self.pieces_of: list[list[tuple[Piece, torch.Tensor]]] = [[] for _ in params]
        for pc, t in zip(self.pieces, self.piece_params):
            self.pieces_of[pc.param].append((pc, t))

    def _model_views(self, device: torch.device) -> None:
        """The parameter buffers (not at ZeRO-3: the store's buckets) and, at ZeRO-1, the
        gradient buffers, with every parameter's ``.data`` and ``.grad`` a view into them."""
        sizes = list(zip(self.layout.dtypes, self.layout.sizes))
        self.param_buffers = (
            []
            if self.store is not None
            else [torch.zeros(n, dtype=dt, device=device) for dt, n in sizes]
        )
        full_grads = self.stage.full_grad_buffer
        self.grad_buffers = (
            [torch.zeros(n, dtype=dt, device=device) for dt, n in sizes] if full_grads else []
        )
        self.grad_views: list[torch.Tensor] = []
        for p, slot in zip(self.params, self.layout.slots):
            span = slice(slot.offset, slot.offset + slot.numel)
            if self.store is None:
                view = self.param_buffers[slot.buffer][span].view(p.shape)
                view.copy_(p.detach())
                p.data = view
            if not full_grads:
                p.grad = None
                continue
            grad = self.grad_buffers[slot.buffer][span].view(p.shape)
            if p.grad is not None:
                grad.copy_(p.grad)
            p.grad = grad
            self.grad_views.append(grad)

    def _allocate_chunks(self, device: torch.device) -> None:
        """The flat fp32 tensors this rank's chunks live in: separate masters, reduced
        gradient shards, the staging buffer, and the offloaded masters on the host."""
        buckets, homes, layout = self.layout.buckets, self.homes, self.layout
        on_device = [b for b in buckets if b.index not in self.offload]
        separate = sum(b.chunk for b in on_device if layout.dtypes[b.buffer] != torch.float32)
        shard = sum(b.chunk for b in on_device if homes[b.index] == SHARD)
        staged = [b.chunk for b, home in zip(buckets, homes) if home == STAGED]
        hosted = sum(b.chunk for b in buckets if b.index in self.offload - self.split)
        halves = [b.chunk for b in buckets if b.index in self.split]
        # offloaded: no reduced gradient on the device either; not pinned: only the host's
        # worker reads them (the new weights go up through the offload's staging)
        self.host_master_flat = torch.zeros(hosted) if hosted else None
        # (2, pad + elements) uint8: the low halves' byte planes, no piece at offset 0 or 1 (the
        # compiled host step is built for offsets past those: master_halves, HostAdamW)
        planes = (2, LOW_PAD + sum(halves))
        self.host_low_flat = torch.zeros(planes, dtype=torch.uint8) if halves else None
        # split buckets' masters as the wrapped optimizer sees them: views of one NaN (no
        # memory) that key their state and are never read (their values: master_values)
        self.split_keys = torch.full((1,), float("nan")).expand(max(halves)) if halves else None
        self.master_flat = torch.zeros(separate, device=device) if separate else None
        self.grad_shard_flat = torch.zeros(shard, device=device) if shard else None
        # (largest staged chunk,) fp32: a staged bucket's gradient while it is stepped
        self.staging = torch.zeros(max(staged), device=device) if staged else None

    def _place_chunks(self) -> None:
        """Each bucket's master chunk and the home of its reduced gradient (module docstring)."""
        full_grads = self.stage.full_grad_buffer
        offset = shard_offset = host_offset = 0
        low_offset = LOW_PAD
        for b, home in zip(self.layout.buckets, self.homes):
            mine = self.own_param(b.index)
            grad = None  # STAGED: no home between steps; offloaded: on the host when stepped
            if b.index in self.split:
                if mine.dtype != torch.bfloat16:
                    raise ValueError(
                        f"split masters need bf16 weights, bucket {b.index}: {mine.dtype}"
                    )
                master = self.split_keys[: b.chunk]
                # (zeros: each master starts as its weight, exactly)
                self.lows[b.index] = self.host_low_flat[:, low_offset : low_offset + b.chunk]
                low_offset += b.chunk
            elif b.index in self.offload:
                master = self.host_master_flat[host_offset : host_offset + b.chunk]
                master.copy_(mine)
                host_offset += b.chunk
            elif mine.dtype == torch.float32 and home == SHARD and not full_grads:
                master = mine  # the fp32 weights' own chunk; the gradient in its slice
                grad = self.grad_shard_flat[shard_offset : shard_offset + b.chunk]
                shard_offset += b.chunk
            elif mine.dtype == torch.float32:
                master = mine
                if home != STAGED:
                    grad = self.own_chunk(b.index, self.grad_buffers)
            else:
                master = self.master_flat[offset : offset + b.chunk]
                master.copy_(mine)
                offset += b.chunk
                if home == SHARD:
                    grad = self.grad_shard_flat[shard_offset : shard_offset + b.chunk]
                    shard_offset += b.chunk
                elif home == INPLACE:  # the first chunk * 4 bytes of the bucket's gradients
                    grads = self.grad_buffers[b.buffer][b.start : b.end]  # (bucket,) 16-bit
                    grad = grads.view(torch.float32)[: b.chunk]  # (bucket/dp,) fp32
            self.masters.append(master)
            self.grad_outs.append(grad)

    @staticmethod
    def _piece(chunks: Sequence[torch.Tensor | None], pc: Piece) -> torch.Tensor:
        return chunks[pc.bucket][pc.chunk_offset : pc.chunk_offset + pc.numel]

    def own_param(self, b: int) -> torch.Tensor:
        """This rank's chunk of bucket ``b``'s weights (in the model's dtype): a view of the
        parameter buffer, or at ZeRO-3 the persistent shard."""
        if self.store is not None:
            return self.store.shards[b]
        return self.own_chunk(b, self.param_buffers)

    def own_chunk(self, b: int, buffers: list[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` in ``buffers`` (the parameter or gradient ones)."""
        bucket = self.layout.buckets[b]
        lo = bucket.chunk_start(self.dp_rank)
        return buffers[bucket.buffer][lo : lo + bucket.chunk]

    @torch.no_grad()
    def staged_grad(self, b: int, coefs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Staged bucket ``b``'s fp32 gradient chunk, made in the staging buffer (valid until
        the next call) and scaled by the clip coefficients ``coefs``, one after the other, as
        the other homes are scaled in place."""
        grad = self.staging[: self.layout.buckets[b].chunk]  # (bucket/dp,) fp32
        grad.copy_(self.own_chunk(b, self.grad_buffers))
        for coef in coefs:
            grad.mul_(coef)
        return grad

    def reduced_grads_by_bucket(
        self,
        coefs: Sequence[torch.Tensor] = (),
        staged_as_is: bool = False,
        skip: Collection[int] = (),
    ) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Every piece's fp32 reduced gradient as ``(piece index, tensor)``, one list per bucket
        in piece order (so norms can be taken a bucket at a time, in one multi-tensor kernel).
        A staged bucket's pieces are views of the staging buffer, valid until the next list is
        asked for; with ``staged_as_is`` (and no ``coefs``) they are views of the 16-bit
        gradients themselves, which hold the same values (for a norm taken in fp32 without
        making the fp32 copy). Buckets in ``skip`` (offloaded ones) are left out."""
        as_is = staged_as_is and not coefs
        group: list[tuple[int, torch.Tensor]] = []
        for k, (pc, grad) in enumerate(zip(self.pieces, self.piece_grads)):
            if pc.bucket in skip:
                continue
            if group and pc.bucket != self.pieces[group[-1][0]].bucket:
                yield group
                group = []
            if grad is None:
                if not group:  # the bucket's first piece: where its gradient chunk is read
                    if as_is:
                        source = self.own_chunk(pc.bucket, self.grad_buffers)
                    else:
                        source = self.staged_grad(pc.bucket, coefs)  # its fp32 gradient, made now
                grad = source[pc.chunk_offset : pc.chunk_offset + pc.numel]
            group.append((k, grad))
        if group:
            yield group

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the parameters' current values into the separate fp32 masters."""
        for b, master in enumerate(self.masters):
            mine = self.own_param(b)
            if b in self.split:
                self.lows[b].zero_()  # (the master is the weight)
            elif master.data_ptr() != mine.data_ptr():
                master.copy_(mine)

    @property
    def host_numel(self) -> int:
        """The elements whose masters live on the host (whole or split)."""
        return sum(b.chunk for b in self.layout.buckets if b.index in self.offload)

    def master_values(self, pc: Piece, master: torch.Tensor) -> torch.Tensor:
        """Piece ``pc``'s fp32 master values (``master``: its tensor in :attr:`piece_params`),
        joined from the weight and the low half where its bucket's masters are split."""
        if pc.bucket not in self.split:
            return master
        span = slice(pc.chunk_offset, pc.chunk_offset + pc.numel)
        weight = self.own_param(pc.bucket)[span].cpu()  # (numel,) bf16
        return join(weight, self.lows[pc.bucket][:, span])

    @torch.no_grad()
    def set_master(self, pc: Piece, master: torch.Tensor, values: torch.Tensor) -> None:
        """Piece ``pc``'s master set to fp32 ``values`` (its weight is the caller's: rounded
        from them); split, its low half alone."""
        if pc.bucket not in self.split:
            master.copy_(values)
            return
        span = slice(pc.chunk_offset, pc.chunk_offset + pc.numel)
        self.lows[pc.bucket][:, span].copy_(low_half(values.to("cpu", torch.float32)))

    @torch.no_grad()
    def gather_params(
        self,
        group: Group,
        changed: Sequence[bool],
        wait: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> dict[int, comm.Work]:
        """Write the masters into the model and all-gather every bucket with a ``changed``
        parameter (``changed`` must be the same on every rank of ``group``).

        Buckets go out in the forward pass's order (the last bucket holds the first layers).
        With ``wait=False`` nothing is waited for: returns ``{bucket: work}`` for the caller to
        wait on before the bucket's parameters are read. ``stream`` (GPUs, ``group`` of two or
        more ranks): issue the fp32 -> 16-bit copies and the collectives there, so the next
        forward can start as soon as its first buckets have arrived. Offloaded buckets
        already hold their new weights: the offload's host step sent them back."""
        works = {}
        with comm.side_stream(stream if comm.size(group) > 1 else None):
            for b in reversed(range(len(self.layout.buckets))):
                bucket, master = self.layout.buckets[b], self.masters[b]
                if not any(changed[i] for i in bucket.params):
                    continue
                mine = self.own_param(b)  # (bucket/dp,)
                if master.data_ptr() != mine.data_ptr() and b not in self.offload:
                    mine.copy_(master)  # fp32 -> the model's dtype
                if self.store is not None:
                    continue  # ZeRO-3: the next use gathers it
                full = self.param_buffers[bucket.buffer][bucket.start : bucket.end]  # (bucket,)
                work = comm.all_gather_into(full, mine, group, async_op=True)
                if work is not None:
                    works[b] = work
        if wait:
            for work in works.values():
                comm.wait(work)
            return {}
        return works
