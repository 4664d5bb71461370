"""The torch behaviour ZeRO relies on beyond torch's documented API, all in this one module.

:class:`~parallax.optim.ZeroOptimizer` is a ``torch.optim.Optimizer`` so that LR schedulers and
optimizer hooks work with it, but the truth (param groups, state, defaults) lives in the
optimizer it wraps, which steps this rank's fp32 master pieces. What that takes, and why:

1. **Groups, state and defaults are the wrapped optimizer's, through properties.** LR schedulers
   read and write ``param_groups[i]["lr"]``; those must be the dicts the wrapped optimizer
   steps with. ``Optimizer.load_state_dict`` replaces the wrapped optimizer's ``param_groups``
   and ``state`` objects (``__setstate__``), so holding the lists themselves would go stale:
   properties always read the current ones.
2. **``Optimizer.__init__`` is called, on the wrapped optimizer's groups.** It builds the hook
   dictionaries (``register_step_pre_hook`` and the others then work) and wraps ``step`` so the
   step hooks and torch's global optimizer hooks run around ZeRO's whole step (once per step;
   hooks registered on the wrapped optimizer run per staged bucket, see
   :mod:`parallax.optim.zero.bucketwise`). It relies on ``__init__`` assigning ``param_groups = []``
   and then calling ``add_param_group`` for each group: through the properties this hands the
   same dicts back to the wrapped optimizer. :meth:`OptimizerFacade._adopt` checks that it did.
3. **Fused optimizers' ``grad_scale``.** torch's fused Adam, AdamW and SGD divide every gradient
   by ``opt.grad_scale`` (a 0-d tensor) inside their kernel when ``opt._step_supports_amp_scaling``
   is set; ``GradScaler`` drives them through the same attribute. ZeRO sets it for one step to
   fold the dp average and the clip coefficient into the kernel (no pass of its own).
4. **Narrowed groups.** Torch optimizers read ``param_groups`` afresh in every ``step()``, skip
   parameters whose ``.grad`` is None and keep state per parameter, so a call with each group's
   ``"params"`` swapped for a subset steps exactly that subset (staged buckets).
5. **Compiled modules.** ``nn.Module.compile()`` stores the compiled forward in
   ``_compiled_call_impl``; a forward pre-hook then goes on the compiled module as a whole.
6. **The end of a backward pass.** ZeRO-2 and 3 reduce each backward pass when it ends: the
   autograd engine's ``queue_callback`` (what torch's own FSDP uses) runs a function once the
   graph task now running is done, and ``torch._C._current_graph_task_id()`` says whether one
   is running (-1 outside a backward; inside, e.g. during an activation-checkpointing
   recomputation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class OptimizerFacade(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose groups, state and defaults are those of ``self.inner``
    (points 1 and 2 of the module docstring) and whose ``state_dict`` holds the subclass's state
    as logical tensors (its ``state_meta``, ``state_tensors`` and ``load_state_tensors``);
    subclasses call :meth:`_adopt` once."""

    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def _adopt(self, inner: torch.optim.Optimizer) -> None:
        """Become the torch face of ``inner``: ``Optimizer.__init__`` on its own groups."""
        self.inner = inner
        groups = list(inner.param_groups)
        self._adopting = True
        try:
            torch.optim.Optimizer.__init__(self, groups, inner.defaults)
        finally:
            self._adopting = False
        if len(inner.param_groups) != len(groups) or any(
            a is not b for a, b in zip(inner.param_groups, groups)
        ):
            raise RuntimeError(
                "torch.optim.Optimizer.__init__ did not hand the wrapped optimizer's param "
                f"groups back (torch {torch.__version__}); see "
                "parallax/optim/zero/torch_contract.py"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_adopting", False):  # Optimizer.__init__ re-adding inner's groups
            super().add_param_group(param_group)
            return
        raise NotImplementedError(
            f"{type(self).__name__}'s buffers are fixed at construction; pass every group then"
        )

    def state_meta(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def load_state_tensors(self, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``{"meta": state_meta(), "tensors": {key: full tensor on CPU}}`` (a subclass's state as
        logical tensors); for big models use :meth:`state_tensors`, which never holds more than
        one full tensor. The hooks of ``register_state_dict_pre_hook`` / ``_post_hook`` run
        around it."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        meta = self.state_meta()
        state_dict = {"meta": meta, "tensors": {k: v.cpu() for k, v in self.state_tensors()}}
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` made, between the load_state_dict pre and post hooks."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        self.load_state_tensors(state_dict["meta"], state_dict["tensors"].__getitem__)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def takes_grad_scale(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` divides every gradient by ``opt.grad_scale`` in its own kernel
    (point 3): torch's fused optimizers, as ``GradScaler`` drives them."""
    return (
        type(opt).__module__.startswith("torch.optim")
        and bool(opt.defaults.get("fused"))
        and bool(getattr(opt, "_step_supports_amp_scaling", False))
    )


@contextmanager
def grad_scale(opt: torch.optim.Optimizer, scale: torch.Tensor) -> Iterator[None]:
    """Let ``opt``'s fused kernel divide the gradients by ``scale`` (0-d) for the block."""
    opt.grad_scale = scale
    try:
        yield
    finally:
        del opt.grad_scale


@contextmanager
def narrowed(inner: torch.optim.Optimizer, members: Sequence[list[torch.Tensor]]) -> Iterator[None]:
    """Let ``inner``'s group ``j`` hold only ``members[j]`` for the duration (point 4)."""
    groups = inner.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g, m in zip(groups, members):
            g["params"] = m
        yield
    finally:
        for g, s in zip(groups, saved):
            g["params"] = s


def private_copy(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A second handle on ``inner`` for another thread: the same state dict, its own group dicts
    (narrowed and scaled there without the caller's thread seeing it, point 4); refresh it with
    :func:`refresh_copy` while that thread is idle."""
    mine = object.__new__(type(inner))  # every attribute shared (copy.copy keeps only three)
    mine.__dict__.update(inner.__dict__)
    mine.param_groups = [dict(g) for g in inner.param_groups]
    return mine


def refresh_copy(mine: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """``mine`` (:func:`private_copy`) with ``inner``'s current state dict and hyperparameters
    (a scheduler's new learning rate; a loaded checkpoint's state, which torch's
    ``load_state_dict`` puts in a new dict)."""
    mine.state = inner.state
    for own, theirs in zip(mine.param_groups, inner.param_groups):
        own.update({k: v for k, v in theirs.items() if k != "params"})


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass (point 6)."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass now running ends (point 6); False (and nothing
    queued) outside a backward pass."""
    if not in_backward():
        return False
    torch.autograd.Variable._execution_engine.queue_callback(callback)
    return True


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` has replaced its forward (point 5)."""
    return getattr(module, "_compiled_call_impl", None) is not None
