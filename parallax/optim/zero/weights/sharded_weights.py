"""ZeRO-3's weights, trainable and frozen, sharded over dp and whole only around each use.

Stage 3 groups the buckets by block (:mod:`~parallax.optim.zero.weights.units`), shards every
weight of the modules over dp, trainable (the flat buffers' store,
:mod:`~parallax.optim.zero.buffers.flat_buffers`) and frozen (a store of its own: a LoRA run's
frozen base is sharded too), and gathers them around each use
(:mod:`~parallax.optim.zero.weights.unit_gathers`). Outside a forward, a weight is read one
tensor at a time with :meth:`ShardedWeights.weight` (a collective over dp) and written unit by
unit inside :meth:`ShardedWeights.materialized`, which needs no collective."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import build_layout
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.weights.shards import ShardedStore
from parallax.optim.zero.weights.unit_gathers import UnitGathers
from parallax.optim.zero.weights.units import Unit


class ShardedWeights:
    """A stage-3 optimizer's weights: its frozen store, the gathers and access outside a forward
    (see the module docstring)."""

    def __init__(
        self,
        units: list[Unit],
        params: Sequence[torch.Tensor],
        trainable: ShardedStore,
        ctx: ParallelContext,
        reducer: PassReducer,
        bucket_numel: int,
        reshard_after_forward: bool,
    ) -> None:
        self.units, self.ctx = units, ctx
        frozen = [(u.index, p) for u in units for p in u.params if not p.requires_grad]
        self.frozen: ShardedStore | None = None
        if frozen:
            layout = build_layout(
                [tuple(p.shape) for _, p in frozen],
                [p.dtype for _, p in frozen],
                [False] * len(frozen),
                ctx.dp_size,
                bucket_numel,
                units=[u for u, _ in frozen],
            )
            device = trainable.shards[0].device if trainable.shards else ctx.device
            self.frozen = ShardedStore([p for _, p in frozen], layout, ctx.dp_rank, device)
        # id(param) -> (its store, its index there)
        self.where = {id(p): (trainable, i) for i, p in enumerate(params)}
        self.where.update({id(p): (self.frozen, i) for i, (_, p) in enumerate(frozen)})
        buckets: list[list[tuple[ShardedStore, int]]] = [[] for _ in units]
        for store in (trainable, self.frozen):
            if store is None:
                continue
            for b in store.layout.buckets:
                buckets[b.unit].append((store, b.index))
        self.gathers = UnitGathers(units, buckets, ctx, reducer, reshard_after_forward)

    @torch.no_grad()
    def weight(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s values on this tp rank, whole: a collective over dp (every dp rank asks for
        the same parameters in the same order)."""
        store, i = self.where[id(p)]
        return store.param_value(i, self.ctx.dp_group).view(p.shape)

    @contextmanager
    def materialized(self, u: int) -> Iterator[None]:
        """Unit ``u``'s weights writable without communicating: write whole parameters into
        them inside the block (each rank keeps its shard of what was written; what was not
        written keeps its values). Not for reading: other ranks' parts are not there."""
        buckets = self.gathers.buckets[u]
        for store, b in buckets:
            store.materialize(b)
        try:
            yield
        finally:
            for store, b in buckets:
                store.commit(b)
                store.release(b)
            self.gathers.gathered[u] = False

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every weight whole for the block (collective): the whole stage's weights on each
        rank, for an export that reads the model as a whole. Each parameter holds a copy of
        its gathered values meanwhile, not a view of the block's buffer: a point-to-point send
        of a tensor (the adapter export's) leaves its storage unresizable, which a gathered
        buffer must not be."""
        saved = []
        for u, unit in enumerate(self.units):
            self.gathers.ensure(u)
            for p in unit.params:
                saved.append((p, p.data))
                p.data = p.data.clone()
            self.gathers.release(u)
        try:
            yield
        finally:
            for p, view in saved:
                p.data = view
