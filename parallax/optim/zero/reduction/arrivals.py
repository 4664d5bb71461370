"""Gradients into ZeRO's flat buffer: the hook on every parameter, and which parameters got one.

Each trainable parameter's ``.grad`` is a view of the flat gradient buffer. A post-accumulate
hook keeps it so (autograd's first gradient after ``zero_grad()`` is a fresh tensor: it is copied
into the view) and tells the reducer. The hooks also mark the parameters: ``param._zero_owner``
holds the owning optimizer's token (an int, so the model stays picklable) for as long as that
optimizer lives. A later optimizer over the same parameters takes them over; the earlier one's
hooks then stand aside. :func:`parallax.tensor.sync_sequence_parallel_grads` reads the mark
to refuse summing gradients that ZeRO sums itself.

At ZeRO-2 and 3 there are no views (``views=None``): each gradient is handed to the
:class:`~parallax.optim.zero.reduction.pass_reducer.PassReducer` as it arrives and ``.grad`` goes
back to None."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch.utils.hooks import RemovableHandle

from parallax import comm
from parallax.comm import Group
from parallax.optim.zero.reduction.bucket_reducer import GradReducer
from parallax.optim.zero.reduction.pass_reducer import PassReducer

_TOKENS = itertools.count(1)  # which optimizer owns a parameter's hook


def _grad_hook(ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    arrivals = ref()
    if arrivals is not None and getattr(param, "_zero_owner", None) == arrivals.token:
        arrivals.on_grad(index, param)


def _release(params: list[torch.Tensor], hooks: list[RemovableHandle], token: int) -> None:
    """The owner is gone: remove its hooks, and its mark where no later owner replaced it."""
    for h in hooks:
        h.remove()
    for p in params:
        if getattr(p, "_zero_owner", None) == token:
            del p._zero_owner


class GradArrivals:
    """The gradient hooks of ``params`` (``views``: their slots in the flat gradient buffer, or
    None at ZeRO-2/3). ``has``: which parameters got a gradient since ``zero_grad()``, a list
    the offload's early steps read too, so it is only ever changed in place."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        views: Sequence[torch.Tensor] | None,
        reducer: GradReducer | PassReducer,
        copy_stream: torch.cuda.Stream | None,
        has: list[bool] | None = None,
    ) -> None:
        self.params, self.views, self.reducer = params, views, reducer
        # where a fresh gradient is copied into the buffer when a step has one backward pass
        self.copy_stream = copy_stream
        self.has = [False] * len(params) if has is None else has
        if len(self.has) != len(params):
            raise ValueError(f"{len(self.has)} gradient flags for {len(params)} parameters")
        self.token = next(_TOKENS)
        ref = weakref.ref(self)
        for p in params:
            p._zero_owner = self.token
        hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, i))
            for i, p in enumerate(params)
        ]
        weakref.finalize(self, _release, list(params), hooks, self.token)

    def on_grad(self, i: int, p: torch.Tensor) -> None:
        # once per parameter and backward pass, so kept lean: no grad-mode switch (neither the
        # view nor a .grad requires grad, so the copy records nothing)
        if self.views is None:  # ZeRO-2/3: into this pass's reduction, then gone
            grad, p.grad = p.grad, None
            self.has[i] = True
            if grad is not None:
                self.reducer.take(i, grad)
            return
        view = self.views[i]
        grad = p.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # .grad was None and autograd made a new tensor: copy it into the buffer. When this
            # is the step's only accumulation, nothing on the compute stream reads the view
            # before the bucket's reduction, which runs on the side stream: copy there
            if self.copy_stream is not None and self.reducer.passes == 1:
                with comm.side_stream(self.copy_stream):
                    view.copy_(grad)
                grad.record_stream(self.copy_stream)  # its memory is reused after the copy
            else:
                view.copy_(grad)
            p.grad = view
        self.has[i] = True
        self.reducer.on_grad(i)

    @torch.no_grad()
    def reattach(self) -> None:
        """Put the views back where ``.grad`` was replaced (e.g. ``model.zero_grad()``)."""
        if self.views is None:
            return
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            g = p.grad
            if g is None:
                view.zero_()
                self.has[i] = False
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                self.has[i] = True
            else:
                continue
            p.grad = view

    @torch.no_grad()
    def clear(self, buffers: Sequence[torch.Tensor], set_to_none: bool) -> None:
        """Forget which parameters got a gradient; ``.grad`` to None, or to zeroed views."""
        self.has[:] = [False] * len(self.params)
        if set_to_none or self.views is None:  # the first gradient is copied, not added
            for p in self.params:
                p.grad = None
            return
        for buf in buffers:
            buf.zero_()
        for p, view in zip(self.params, self.views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def global_flags(self, group: Group, device: torch.device) -> list[bool]:
        """Which parameters got a gradient on any rank of ``group`` (collective).

        Every rank takes part in the all-reduce, but a rank reads the result back (a host
        synchronisation) only if it lacks a gradient itself: when every local flag is set, so
        is every global one. Training where each step reaches every parameter never waits."""
        flags = torch.tensor(self.has, dtype=torch.float32).to(device, non_blocking=True)
        if self.params:
            comm.all_reduce(flags, group, op="max")
        if all(self.has):
            return [True] * len(self.params)
        return [bool(f) for f in flags.tolist()]
