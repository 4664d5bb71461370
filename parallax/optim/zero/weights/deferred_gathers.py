"""The parameter all-gathers that ``ZeroOptimizer.step()`` may leave running under the next forward.

With hooks registered (:meth:`DeferredGathers.register`), ``step()`` returns with one
all-gather per bucket in flight, launched in forward order, and a forward pre-hook on each
module that holds parameters waits for exactly the buckets it reads (on GPUs the wait orders
the streams; the host goes on). A compiled module is one hook point for all its parameters: a
hook inside compiled code would be traced.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from parallax import comm
from parallax.eager import eager
from parallax.optim.zero.torch_contract import is_compiled


def hook_points(module: nn.Module) -> Iterator[tuple[nn.Module, bool]]:
    """Where a forward pre-hook sees every parameter of ``module`` before it is read:
    ``(submodule, recursive)``. A compiled submodule is one point for all its parameters;
    elsewhere each module with parameters of its own, in registration order (about the
    forward order)."""
    if is_compiled(module):
        yield module, True
        return
    if next(module.parameters(recurse=False), None) is not None:
        yield module, False
    for child in module.children():
        yield from hook_points(child)


@eager  # runs eagerly in front of a compiled block, without a graph break in it
def _gather_hook(ref: weakref.ref, buckets: tuple[int, ...], module: nn.Module, args) -> None:
    gathers = ref()
    if gathers is not None and gathers.works:
        gathers.wait(buckets)


class DeferredGathers:
    """The all-gathers in flight (``works``: bucket -> handle) and the hooks that wait."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_of: Sequence[int]) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.bucket_of = bucket_of
        self.works: dict[int, comm.Work] = {}
        self.hooks: list[RemovableHandle] = []

    @property
    def deferred(self) -> bool:
        """Whether ``step()`` leaves its all-gathers to the hooks."""
        return bool(self.hooks)

    def register(self, modules: Iterable[nn.Module]) -> list[_Handle]:
        """A forward pre-hook on each hook point of ``modules`` for the buckets it reads."""
        ref, handles = weakref.ref(self), []
        for module in modules:
            for point, recursive in hook_points(module):
                buckets = {
                    self.bucket_of[self.index[id(p)]]
                    for p in point.parameters(recurse=recursive)
                    if id(p) in self.index
                }
                if not buckets:
                    continue
                hook = functools.partial(_gather_hook, ref, tuple(sorted(buckets)))
                handle = point.register_forward_pre_hook(hook)
                self.hooks.append(handle)
                handles.append(_Handle(handle, self.hooks))
        return handles

    def track(self, works: dict[int, comm.Work]) -> None:
        """The all-gathers ``step()`` left in flight (``{bucket: handle}``, empty when it
        waited), for the hooks to wait on."""
        self.works = works

    def wait(self, buckets: Iterable[int]) -> None:
        for b in buckets:
            comm.wait(self.works.pop(b, None))

    def wait_all(self) -> None:
        self.wait(tuple(self.works))


class _Handle:
    """A forward pre-hook's handle that also forgets the hook in the optimizer's list."""

    def __init__(self, handle: RemovableHandle, registry: list[RemovableHandle]) -> None:
        self.handle, self.registry = handle, registry

    def remove(self) -> None:
        self.handle.remove()
        if self.handle in self.registry:
            self.registry.remove(self.handle)
