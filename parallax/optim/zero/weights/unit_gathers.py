"""ZeRO-3's gathers: each unit's weights whole just before it runs, the next one prefetched,
released after.

Forward: a unit's forward pre-hook waits for (or makes) its all-gather and starts the next unit's,
in the order recorded during the first step; its forward hook releases it
(``reshard_after_forward``) and hooks the gradients of its outputs. Backward: when the first
gradient of its outputs is computed (a multi-grad hook: before the unit's own backward runs) the
unit is gathered again and the one before it prefetched; when the gradients of all its inputs are
computed (its backward is over) it is released and its gradient buckets are reduced
(:meth:`~parallax.optim.zero.reduction.pass_reducer.PassReducer.launch_unit`). A unit whose inputs
need no gradient (an embedding, the first block of a first stage) has nothing left to do once all
its trainable parameters have their gradients, so it ends then; one whose parameters do not all get
a gradient ends with the backward pass. Where a unit's input is the previous unit's output (a stack
of blocks) one hook does both, the finished unit's release first, so at any time a rank holds at
most the blocks running (a block and the units it is nested in) plus the prefetched one; never one
per microbatch in flight, however a pipeline schedule interleaves forwards and backwards, because
each use gathers and releases again.

``reshard_after_forward=False`` keeps every unit gathered from its first forward until the
optimizer step: the stage's whole weights (1/tp of its blocks) during the step, but one
all-gather per unit per step instead of two per microbatch (a pipeline's microbatches share
them). Either way a recomputation (activation checkpointing) finds its unit already gathered
for the backward.

Hooks run eagerly in front of and behind compiled blocks (:func:`parallax.eager.eager`), so the
collectives stay outside the graphs, and a compiled block reads its weights as graph inputs:
their storage comes and goes between calls without a recompilation. CUDA graphs cannot work
here: a replay reads each weight at the address it was recorded with, and a block's gathered
weights land wherever the allocator puts them at each gather (and are gone between uses), so
``--cuda-graphs`` with ``--zero 3`` is refused by the config (stage 2 keeps whole weights and
works with them). Every dp rank must run the same units in the same order (the collectives pair
up by order), as torch's FSDP requires.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from parallax import comm
from parallax.context import ParallelContext
from parallax.eager import eager
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.torch_contract import in_backward
from parallax.optim.zero.weights.shards import ShardedStore
from parallax.optim.zero.weights.units import Unit


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _opaque(output: Any) -> bool:
    """An output whose tensors the hooks cannot see (an object torch's pytree does not open)."""
    return output is not None and not isinstance(output, torch.Tensor | tuple | list | dict)


@eager
def _pre_forward(ref: weakref.ref, u: int, module, args, kwargs) -> None:
    gathers = ref()
    if gathers is not None:
        gathers.pre_forward(u, (args, kwargs))


@eager
def _post_forward(ref: weakref.ref, u: int, module, args, output) -> None:
    gathers = ref()
    if gathers is not None:
        gathers.post_forward(u, output)


def _call(ref: weakref.ref, calls: tuple[tuple[str, int], ...], grads: Any) -> None:
    """A gradient hook: ``gathers.<method>(unit)`` for each of ``calls``, in order."""
    gathers = ref()
    if gathers is not None:
        for method, u in calls:
            getattr(gathers, method)(u)


class UnitGathers:
    """The units of one ZeroOptimizer at stage 3 and their hooks (see the module docstring)."""

    def __init__(
        self,
        units: Sequence[Unit],
        buckets: Sequence[list[tuple[ShardedStore, int]]],
        ctx: ParallelContext,
        reducer: PassReducer,
        reshard_after_forward: bool,
    ) -> None:
        self.units, self.buckets, self.ctx = units, buckets, ctx  # buckets[u]: (store, b)
        self.reducer, self.reshard = reducer, reshard_after_forward
        self.works: dict[tuple[int, int], comm.Work] = {}  # prefetches in flight
        self.active: set[int] = set()  # units whose backward began and has not ended
        self.order: list[int] = []  # units in the order their forwards ran (first step)
        self.position: dict[int, int] = {}
        self.recording = True
        self.gathered = [False] * len(units)
        self.peak_bytes = 0
        # units whose last forward took no input that needs a gradient: they end when all
        # their trainable parameters have arrived (counted per pass)
        self.trainable = [sum(p.requires_grad for p in unit.params) for unit in units]
        self.inputless: set[int] = set()
        self.arrived = [0] * len(units)
        self.ended: set[int] = set()  # units whose backward ended in this pass
        self._out_hooks: dict[int, tuple[Any, int, weakref.ref]] = {}  # id(output) -> hook
        self.stores = list({id(s): s for bs in buckets for s, _ in bs}.values())
        # what must happen before a bucket is read (the offloaded step's upload, when the step
        # was left running under the forward): before(store, b)
        self.before: Callable[[ShardedStore, int], None] | None = None
        reducer.follow(self)  # its arrivals and pass ends come here
        ref = weakref.ref(self)
        self.handles = []
        for unit in units:
            pre = functools.partial(_pre_forward, ref, unit.index)
            post = functools.partial(_post_forward, ref, unit.index)
            self.handles.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(post))
        self._ref = ref

    # -- gathering -------------------------------------------------------------------------------
    def gathered_bytes(self) -> int:
        return sum(s.gathered_bytes() for s in self.stores)

    def ensure(self, u: int) -> None:
        """Unit ``u`` whole: wait for its prefetch, or gather it now."""
        for store, b in self.buckets[u]:
            if self.before is not None:
                self.before(store, b)
            work = self.works.pop((id(store), b), None)
            if work is not None:
                comm.wait(work)
            else:
                store.gather(b, self.ctx.dp_group)
        self.gathered[u] = True
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())

    def prefetch(self, u: int | None) -> None:
        if u is None or self.gathered[u]:
            return
        for store, b in self.buckets[u]:
            if self.before is not None:
                self.before(store, b)
            if (id(store), b) not in self.works and not store.gathered[b]:
                self.works[(id(store), b)] = store.gather(b, self.ctx.dp_group, async_op=True)
        self.gathered[u] = True
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())

    def release(self, u: int) -> None:
        for store, b in self.buckets[u]:
            comm.wait(self.works.pop((id(store), b), None))
            store.release(b)
        self.gathered[u] = False

    def release_all(self) -> None:
        """The step: every unit back to its shard (its weights are about to change)."""
        for u in range(len(self.units)):
            if self.gathered[u]:
                self.release(u)
        self.active.clear()
        self._out_hooks.clear()
        if self.recording and self.order:
            self.recording = False
            self.position = {u: k for k, u in enumerate(self.order)}

    def _neighbour(self, u: int, step: int) -> int | None:
        k = self.position.get(u)
        if k is None or not 0 <= k + step < len(self.order):
            return None
        v = self.order[k + step]
        return v if self.units[v].chunk == self.units[u].chunk else None

    # -- the hooks -------------------------------------------------------------------------------
    def pre_forward(self, u: int, inputs: Any) -> None:
        self.ensure(u)
        if in_backward():  # a recomputation: its backward gathered it
            return
        if self.recording and u not in self.order:
            self.order.append(u)
        self.prefetch(self._neighbour(u, +1))
        tensors = _grad_tensors(inputs) if torch.is_grad_enabled() else []
        if not tensors:
            self.inputless.add(u)
            return
        self.inputless.discard(u)
        calls: tuple[tuple[str, int], ...] = (("post_backward", u),)
        if len(tensors) == 1 and id(tensors[0]) in self._out_hooks:
            handle, v, t = self._out_hooks.pop(id(tensors[0]))
            if t() is tensors[0]:  # the previous unit's output: one hook, this unit first
                handle.remove()
                calls += (("pre_backward", v),)
        register_multi_grad_hook(tensors, functools.partial(_call, self._ref, calls), mode="all")

    def post_forward(self, u: int, output: Any) -> None:
        if in_backward():
            return
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        held = self.units[u].keep or (torch.is_grad_enabled() and not self.reshard)
        if tensors:
            begin = functools.partial(_call, self._ref, (("pre_backward", u),))
            handle = register_multi_grad_hook(tensors, begin, mode="any")
            if len(tensors) == 1:
                self._out_hooks[id(tensors[0])] = (handle, u, weakref.ref(tensors[0]))
        elif torch.is_grad_enabled() and _opaque(output):
            held = True  # outputs hidden from the hooks: keep the weights for the backward
        if not held:
            self.release(u)

    def pre_backward(self, u: int) -> None:
        self.ensure(u)
        self.active.add(u)
        self.reducer.touch(self.units[u].index)
        before = self._neighbour(u, -1)
        if before not in self.ended:  # (a tower's embeddings may be done before its first block)
            self.prefetch(before)

    def on_grad(self, u: int) -> None:
        """A trainable parameter of unit ``u`` got this pass's gradient."""
        self.arrived[u] += 1
        if u in self.inputless and self.arrived[u] == self.trainable[u] and u in self.active:
            self.post_backward(u)

    def post_backward(self, u: int) -> None:
        self.active.discard(u)
        self.ended.add(u)
        if self.reshard and not self.units[u].keep:
            self.release(u)
        self.reducer.launch_unit(u)

    def end_pass(self) -> None:
        """The backward pass is over: units still active end now."""
        for u in sorted(self.active):
            self.post_backward(u)
        self.arrived = [0] * len(self.units)
        for key in list(self.works):  # prefetches nobody used (a unit that did not run)
            comm.wait(self.works.pop(key))
        self._out_hooks.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
