"""What ZeRO-2 and 3 add to the ZeRO-1 optimizer: units of parameters, and ZeRO-3's weights.

Stage 2 groups the buckets by model chunk (the modules given; a bucket never spans two) so that each
backward pass reduces the buckets of the chunks it ran
(:mod:`parallax.optim.zero.reduction.pass_reducer`). Stage 3 groups them by block
(:mod:`parallax.optim.zero.weights.units`), shards every weight of the modules over dp, trainable
(:class:`~parallax.optim.zero.buffers.flat_buffers.FlatBuffers`' store) and frozen (a store of its
own: a LoRA run's frozen base is sharded too), and gathers them around each use
(:mod:`parallax.optim.zero.weights.unit_gathers`). Outside a forward, a weight is read one tensor at
a time with :meth:`Zero3.weight` (a collective over dp) and written unit by unit inside
:meth:`Zero3.materialized`, which needs no collective."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import build_layout
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.weights.shards import ShardedStore
from parallax.optim.zero.weights.unit_gathers import UnitGathers
from parallax.optim.zero.weights.units import Unit, check_trainable, find_units, unit_of_params

STAGES = (1, 2, 3)


def check_stage(stage: object, modules: Sequence[nn.Module] | None) -> list[nn.Module]:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
    if modules is None:
        if stage == 3:
            raise ValueError("ZeRO-3 needs the modules whose weights it shards (modules=...)")
        return []
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    if not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("modules must be nn.Modules")
    return modules


def parameter_units(
    stage: int, modules: list[nn.Module], params: Sequence[torch.Tensor]
) -> tuple[list[Unit], list[int] | None]:
    """The units (stage 3) and each trainable parameter's unit: its block at stage 3, its
    chunk at stage 2 (``None``: one unit, stage 1 or no modules)."""
    if stage == 3:
        units = find_units(modules)
        problem = check_trainable(units, params)
        if problem:
            raise ValueError(problem)
        where = unit_of_params(units)
        return units, [where[id(p)] for p in params]
    if stage == 2 and modules:
        chunk = {id(p): c for c, m in enumerate(modules) for p in m.parameters()}
        missing = sum(1 for p in params if id(p) not in chunk)
        if missing:
            raise ValueError(
                f"ZeRO-2: {missing} of the optimizer's parameters are not in the modules given"
            )
        return [], [chunk[id(p)] for p in params]
    return [], None


def grouped_order(order: list[int] | None, unit_of: list[int] | None, n: int) -> list[int] | None:
    """The forward order with each unit's parameters together, units in their own order."""
    if unit_of is None:
        return order
    base = list(range(n)) if order is None else order
    rank = {i: k for k, i in enumerate(base)}
    return sorted(range(n), key=lambda i: (unit_of[i], rank[i]))


class Zero3:
    """A stage-3 optimizer's frozen weights, gathers and weight access (see the module doc)."""

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


class WeightMethods:
    """ZeroOptimizer's access to the weights outside a forward (stage 3 shards them)."""

    def weight(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter ``p``'s current values on this tp rank, whole (any parameter of the
        modules, frozen ones included). At stage 3 a collective over dp: every dp rank asks
        for the same parameters in the same order; one tensor is made, never a whole block."""
        self.wait_params()
        if self.zero3 is None:
            return p.detach()
        return self.zero3.weight(p)

    def materialized(self, unit: int):
        """Stage 3: a context in which unit ``unit``'s weights (``self.units[unit]``) can be
        overwritten whole, with no collective (see :meth:`Zero3.materialized`)."""
        return self.zero3.materialized(unit)

    def gathered(self):
        """A context with every weight whole, e.g. to export the model (at stage 3 a collective
        that gathers the whole stage on every rank; otherwise it only waits for the weights)."""
        if self.zero3 is None:
            self.wait_params()
            return nullcontext()
        return self.zero3.gathered()
