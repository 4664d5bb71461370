"""ZeRO-1: a wrapper that shards any torch optimizer's state over the data-parallel group.

Every dp rank holds the whole model (parameters and gradients, in flat per-dtype buffers the
parameters are views into) but keeps optimizer state for its own slice of each bucket only.
A step is: reduce-scatter the gradients over dp (fp32, averaged), step the wrapped optimizer on
this rank's fp32 master slice, all-gather the updated slices back into the model. Sharding is
within ``ctx.dp_group``; tp and pp peers hold different parameters and shard them separately.
At dp=1 with 16-bit parameters nothing is reduced, and each bucket's fp32 gradient is made
only while the optimizer steps that bucket (:mod:`parallax.optim.staged`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim import state as state_io
from parallax.optim.buckets import build_layout, grad_homes
from parallax.optim.clip import clip_coefficient, global_grad_norm
from parallax.optim.flat import FlatBuffers
from parallax.optim.groups import (
    check_agreement,
    forward_order,
    normalize_param_groups,
    trainable,
)
from parallax.optim.memory import MemoryReport, plain_adamw_bytes, tensor_bytes
from parallax.optim.reducer import GradReducer
from parallax.optim.staged import StagedSteps

log = logging.getLogger(__name__)

DEFAULT_BUCKET_NUMEL = 25_000_000  # 50 MB of bf16 gradients per reduce-scatter
_TOKENS = itertools.count(1)  # which optimizer owns a parameter's hook


def _grad_hook(opt_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    opt = opt_ref()
    # a later ZeroOptimizer over the same parameter owns it now: this one stands aside
    if opt is not None and getattr(param, "_zero_owner", None) == opt._token:
        opt._on_grad(index, param)


@torch.compiler.disable  # runs eagerly in front of a compiled block, without a graph break in it
def _gather_hook(opt_ref: weakref.ref, buckets: tuple[int, ...], module: nn.Module, args) -> None:
    opt = opt_ref()
    if opt is not None and opt._gathers:
        opt._wait_buckets(buckets)


def hook_points(module: nn.Module) -> Iterator[tuple[nn.Module, bool]]:
    """Where a forward pre-hook sees every parameter of ``module`` before it is read:
    ``(submodule, recursive)``. A compiled submodule is one point for all its parameters (a
    hook inside compiled code would be traced); elsewhere each module with parameters of its
    own, in registration order (about the forward order)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        yield module, True
        return
    if next(module.parameters(recurse=False), None) is not None:
        yield module, False
    for child in module.children():
        yield from hook_points(child)


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard ``optimizer_class``'s state over ``ctx.dp_group``; see the module docstring.

    ``params``: parameters, param-group dicts, or ``(name, param)`` pairs (``named_parameters()``)
    or groups of them; names key the saved state. Parameters with ``requires_grad=False`` are
    left alone. Build it after the model has its final device and dtype: the parameters become
    views into the optimizer's buffers.

    ``overlap``: reduce-scatter a bucket from a backward hook as soon as each of its parameters
    has had ``backward_passes_per_step`` gradient accumulations (the micro-batches of a pipeline
    schedule times the accumulation steps). ``step()`` always completes the reduction, so fewer
    passes, unused parameters or ``overlap=False`` are all correct; more passes raise.
    Buckets go out in a fixed order, from the end of ``param_order`` (the order the forward pass
    uses the parameters, e.g. ``model.parameters()``; default: as given, groups concatenated),
    and a parameter without a gradient holds back its bucket and all later ones until ``step()``.
    The hooks' collectives share ``ctx.dp_group`` with the model's: a model that communicates
    over dp in its backward must build the same graph on every dp rank, or use overlap=False.
    With 16-bit parameters at dp >= 2, overlap keeps each bucket's fp32 reduced gradient in a
    persistent slice (4/dp bytes per parameter); without it, the fp32 result is written over the
    bucket's own 16-bit gradient bytes. At dp=1 no fp32 gradient outlives the step of its bucket
    (see :mod:`parallax.optim.buckets`, ``grad_homes``). Either way, after the reduction the
    ``.grad`` of 16-bit parameters holds unspecified values.

    On GPUs at dp >= 2 the reduction's copies and collectives run on a side stream; with one
    backward pass per step, so does the copy of each fresh gradient into the buffer
    (``side_stream_grad_copies``). Turn that off when gradients come out of CUDA graphs
    (torch.compile's reduce-overhead mode): their memory is reused by the next replay on the
    compute stream, which would not wait for a copy on another stream.
    """

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

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer],
        ctx: ParallelContext,
        *,
        overlap: bool = True,
        backward_passes_per_step: int = 1,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        param_order: Iterable[torch.Tensor] | None = None,
        side_stream_grad_copies: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        _check_passes(backward_passes_per_step)
        groups = normalize_param_groups(params)
        self.ctx, self.overlap = ctx, overlap
        # the trainable parameters, in the order given: names, tensors, group index
        self.names, self.params, group_of = trainable(groups)
        self._group_names = [
            [n for n, gi in zip(self.names, group_of) if gi == j] for j in range(len(groups))
        ]
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"ZeroOptimizer: parameters are on several devices {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else ctx.device
        sp = [bool(getattr(p, "sequence_parallel", False)) for p in self.params]
        check_agreement(
            ctx,
            [
                (n, tuple(p.shape), str(p.dtype), s, g)
                for n, p, s, g in zip(self.names, self.params, sp, group_of)
            ],
        )
        self.layout = build_layout(
            [tuple(p.shape) for p in self.params],
            [p.dtype for p in self.params],
            sp,
            ctx.dp_size,
            bucket_numel,
            forward_order(self.params, self.names, param_order),
        )
        self.flat = FlatBuffers(
            self.params, self.layout, ctx.dp_rank, self.device, self._grad_homes()
        )
        members: list[list[torch.Tensor]] = [[] for _ in groups]  # this rank's pieces per group
        for pc, t in zip(self.flat.pieces, self.flat.piece_params):
            members[group_of[pc.param]].append(t)
        self.staged = StagedSteps(self.flat, [group_of[pc.param] for pc in self.flat.pieces])
        self._coefs: list[torch.Tensor] = []  # clip coefficients, for staged buckets
        self.inner = optimizer_class(
            [{"params": m, **g.options} for m, g in zip(members, groups)], **optimizer_kwargs
        )
        # The torch.optim.Optimizer interface (LR schedulers use it) is the wrapped optimizer's
        # groups, state and defaults, through properties: load_state_dict replaces the inner
        # lists, and a scheduler must keep steering the groups the inner optimizer really uses.
        # Optimizer.__init__ is not called, it would register our parameters.
        for kind in ("step", "state_dict", "load_state_dict"):
            for when in ("pre", "post"):
                setattr(self, f"_optimizer_{kind}_{when}_hooks", OrderedDict())

        # GPUs at dp >= 2: staging copies, reduce-scatters and all-gathers beside the compute
        self._stream = (
            torch.cuda.Stream(self.device)
            if self.device.type == "cuda" and ctx.dp_size > 1
            else None
        )
        # torch's fused optimizers divide the gradients by ``grad_scale`` inside their kernel:
        # the dp average and the clip coefficient then cost no pass over the gradients
        self._fold = _takes_grad_scale(self.inner)
        self._side_copies = side_stream_grad_copies
        # where the hook copies a fresh gradient into the buffer when a step has one backward
        self._copy_stream = self._stream if side_stream_grad_copies and overlap else None
        self._unscale: torch.Tensor | None = None  # clip coefficients folded into the step
        self._gathers: dict[int, comm.Work] = {}  # bucket -> all-gather in flight (deferred)
        self._gather_hooks: list[RemovableHandle] = []
        self._has_grad = [False] * len(self.params)  # a gradient arrived since zero_grad()
        self._flags: list[bool] | None = None  # the dp-global has_grad, once reduced this step
        self.reducer = GradReducer(
            self.layout,
            self.flat.grad_buffers,
            self.flat.grad_outs,
            self.names,
            ctx,
            overlap,
            backward_passes_per_step,
            average=not self._fold,
            stream=self._stream,
        )
        ref, self._token = weakref.ref(self), next(_TOKENS)
        for p in self.params:
            p._zero_owner = self._token  # an int: the model stays picklable
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, i))
            for i, p in enumerate(self.params)
        ]
        log.debug(
            "ZeroOptimizer: %d params, %d buckets, %s",
            len(self.params),
            len(self.layout.buckets),
            self.memory_report(),
        )

    def _grad_homes(self) -> list[str]:
        """Where each bucket's fp32 reduced gradient lives (see ``buckets.grad_homes``)."""
        return grad_homes(self.layout, self.overlap)

    @torch.no_grad()
    def reload_master_weights(self) -> None:
        """Copy the model's current parameter values into the fp32 masters (no communication).

        Call it after writing weights into the model behind the optimizer's back; otherwise, for
        non-fp32 parameters, the masters are the truth and the next step overwrites them.
        """
        self.wait_params()
        self.flat.reload_masters()

    # -- accumulation --------------------------------------------------------------------------
    @property
    def backward_passes_per_step(self) -> int:
        return self.reducer.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, value: int) -> None:
        _check_passes(value)
        if self.reducer.dirty:
            raise RuntimeError("change backward_passes_per_step between steps, not during one")
        self.reducer.passes = value

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        # once per parameter and backward pass, so kept lean: no grad-mode switch (neither the
        # view nor a .grad requires grad, so the copy records nothing)
        view = self.flat.grad_views[i]
        grad = p.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # .grad was None and autograd made a new tensor: copy it into the buffer. When this
            # is the step's only accumulation, nothing on the compute stream reads the view
            # before the bucket's reduction, which runs on the side stream: copy there
            if self._copy_stream is not None and self.reducer.passes == 1:
                with comm.side_stream(self._copy_stream):
                    view.copy_(grad)
                grad.record_stream(self._copy_stream)  # its memory is reused after the copy
            else:
                view.copy_(grad)
            p.grad = view
        self._has_grad[i] = True
        self.reducer.on_grad(i)

    @torch.no_grad()
    def _reattach_grads(self) -> None:
        """Put the views back where ``.grad`` was replaced (e.g. ``model.zero_grad()``)."""
        for i, (p, view) in enumerate(zip(self.params, self.flat.grad_views)):
            g = p.grad
            if g is None:
                view.zero_()
                self._has_grad[i] = False
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                self._has_grad[i] = True
            else:
                continue
            p.grad = view

    @torch.no_grad()
    def _reduce(self) -> list[bool]:
        """Finish the gradient reduction (once per step); which parameters got a gradient on any
        dp rank.

        Every rank takes part in the flags' all-reduce, but a rank reads the result back (a host
        synchronisation) only if it lacks a gradient itself: when every local flag is set, so
        is every global one. Training where each step reaches every parameter never waits."""
        if self._flags is None:
            self._reattach_grads()
            self.reducer.finish()
            flags = torch.tensor(self._has_grad, dtype=torch.float32)
            flags = flags.to(self.device, non_blocking=True)
            if self.params:
                comm.all_reduce(flags, self.ctx.dp_group, op="max")
            if all(self._has_grad):
                self._flags = [True] * len(self.params)
            else:
                self._flags = [bool(f) for f in flags.tolist()]
        return self._flags

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce gradients (if not done yet), step the fp32 slices, gather the parameters.

        A parameter no dp rank saw a gradient for is skipped, as torch optimizers skip a
        ``.grad`` of None: no weight decay, no moment update.
        """
        self.wait_params()  # buckets no forward read since the last step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flags = self._reduce()
        stepped = False  # pieces whose fp32 gradient already has its home: one step for all
        for pc, t, g in zip(self.flat.pieces, self.flat.piece_params, self.flat.piece_grads):
            t.grad = g if g is not None and flags[pc.param] else None
            stepped = stepped or g is not None
        with self._grad_scale():
            if stepped:
                self.inner.step()
            self.staged.step(self.inner, flags, self._coefs)  # the others, bucket by bucket
        self._gathers = self.flat.gather_params(
            self.ctx.dp_group, flags, wait=not self._gather_hooks, stream=self._stream
        )
        self.reducer.reset()
        self._flags, self._coefs, self._unscale = None, [], None
        return loss

    @contextmanager
    def _grad_scale(self) -> Iterator[None]:
        """When the wrapped optimizer folds scales, the reduced gradients hold dp sums, not yet
        clipped: let it divide them by ``dp / clip coefficients`` inside its kernel."""
        dp = self.ctx.dp_size
        if not self._fold or (dp == 1 and self._unscale is None):
            yield
            return
        if self._unscale is None:
            scale = torch.full((), float(dp), device=self.device)
        else:
            scale = dp / self._unscale
        self.inner.grad_scale = scale
        try:
            yield
        finally:
            del self.inner.grad_scale

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients and accumulation.

        With ``set_to_none`` (the default) ``.grad`` becomes None, as in torch: the backward
        pass's first gradient is then copied into the parameter's view of the gradient buffer
        (one pass over it instead of zeroing and adding). Otherwise ``.grad`` stays a zeroed
        view. Whether a parameter got a gradient is tracked by hooks either way. Call it
        between steps: after ``step()`` (and, for 16-bit parameters, after ``grad_norm()``),
        gradients hold unspecified (partly reduced) values.
        """
        if self.overlap and self.reducer.dirty and not self.reducer.done:
            self.reducer.finish()  # keep every rank's sequence of collectives aligned
        self.reducer.reset()
        self._flags, self._coefs, self._unscale = None, [], None
        self._has_grad = [False] * len(self.params)
        if set_to_none:  # the first gradient is copied into the view, not added to zeros
            for p in self.params:
                p.grad = None
            return
        for buf in self.flat.grad_buffers:
            buf.zero_()
        for p, view in zip(self.params, self.flat.grad_views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    # -- the parameter all-gather under the next forward ------------------------------------------
    def overlap_param_gather(self, *modules: nn.Module) -> list[RemovableHandle]:
        """Let each step's all-gather of the updated parameters run under the next forward.

        ``step()`` then returns with the all-gathers in flight, launched in forward order, and a
        forward pre-hook on each of ``modules``' parameter holders (see :func:`hook_points`)
        waits for the buckets it reads (on GPUs the wait orders the streams; the host goes on).
        Every parameter must be read inside the forward of a module that holds it (or of a
        compiled ancestor), not through another module's attribute. Anything else that reads
        parameters between ``step()`` and the next forward calls :meth:`wait_params` first;
        this optimizer's own methods do. Returns the hooks' handles; removing them all turns the
        deferral off again.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        bucket_of = [slot.bucket for slot in self.layout.slots]
        ref = weakref.ref(self)
        handles = []
        for module in modules:
            for point, recursive in hook_points(module):
                buckets = {
                    bucket_of[index[id(p)]]
                    for p in point.parameters(recurse=recursive)
                    if id(p) in index
                }
                if not buckets:
                    continue
                hook = functools.partial(_gather_hook, ref, tuple(sorted(buckets)))
                handle = point.register_forward_pre_hook(hook)
                self._gather_hooks.append(handle)
                handles.append(_Handle(handle, self._gather_hooks))
        return handles

    def wait_params(self) -> None:
        """Finish every parameter all-gather still in flight (see :meth:`overlap_param_gather`):
        call it before reading parameters outside a hooked forward, e.g. to save or evaluate."""
        self._wait_buckets(tuple(self._gathers))

    def _wait_buckets(self, buckets: Iterable[int]) -> None:
        for b in buckets:
            comm.wait(self._gathers.pop(b, None))

    # -- clipping ------------------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over dp, tp and pp (every rank must call it); reduces the
        gradients first if ``step()`` has not yet."""
        self._reduce()
        replicated = [
            getattr(self.params[pc.param], "tp_shard", None) is None for pc in self.flat.pieces
        ]
        counted = (  # tp-replicated pieces count on tp rank 0 only
            [g for k, g in group if not replicated[k] or self.ctx.tp_rank == 0]
            # staged buckets: their 16-bit gradients, the norm taken in fp32
            for group in self.flat.reduced_grads_by_bucket(self._coefs, staged_as_is=True)
        )
        total = global_grad_norm(counted, self.ctx, norm_type, self.device)
        if self._fold:  # the reduced gradients hold dp sums (and no clip coefficient yet)
            if self.ctx.dp_size > 1:
                total = total / self.ctx.dp_size
            if self._unscale is not None:
                total = total * self._unscale
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the norm before.
        (Staged buckets are scaled when ``step()`` makes their fp32 gradients.)"""
        total = self.grad_norm(norm_type)
        coef = clip_coefficient(total, max_norm)
        if self._fold:  # applied by the optimizer's kernel in step()
            self._unscale = coef if self._unscale is None else self._unscale * coef
            return total
        for out in self.flat.grad_outs:
            if out is not None:
                out.mul_(coef)
        if self.staged:
            self._coefs.append(coef)
        return total

    # -- state ---------------------------------------------------------------------------------
    def state_meta(self) -> dict[str, Any]:
        """JSON-able description of the state: hyperparameters and, per parameter name, the
        state keys that :meth:`state_tensors` yields. Collective: call on every rank."""
        self.wait_params()
        return state_io.state_meta(self)

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``("<name>.<state>", full logical tensor)`` one at a time (see
        :mod:`parallax.optim.state`). Collective: every rank must consume it all."""
        self.wait_params()
        return state_io.state_tensors(self)

    def load_state_tensors(self, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
        """Load from ``meta`` and ``get(key) -> full tensor``, one tensor at a time, at any
        dp and tp size. Also writes the masters into the model's parameters."""
        self.wait_params()
        state_io.load_state_tensors(self, meta, get)

    def state_dict(self) -> dict[str, Any]:
        """``{"meta": state_meta(), "tensors": {key: full tensor on CPU}}``; for big models use
        :meth:`state_tensors`, which never holds more than one full tensor."""
        meta = self.state_meta()
        return {"meta": meta, "tensors": {k: v.cpu() for k, v in self.state_tensors()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        tensors = state_dict["tensors"]
        self.load_state_tensors(state_dict["meta"], tensors.__getitem__)

    # -- reporting -----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, measured from the tensors, and what plain AdamW would need."""
        states = [
            v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        masters, grads = self.flat.master_flat, self.flat.grad_shard_flat
        return MemoryReport(
            numel=sum(p.numel() for p in self.params),
            dp=self.ctx.dp_size,
            param_bytes=tensor_bytes(self.flat.param_buffers),
            grad_bytes=tensor_bytes(self.flat.grad_buffers),
            master_bytes=tensor_bytes([masters] if masters is not None else []),
            grad_shard_bytes=tensor_bytes([grads] if grads is not None else []),
            state_bytes=tensor_bytes(states),
            plain_adamw_bytes=plain_adamw_bytes(self.params),
            staging_bytes=tensor_bytes([self.flat.staging, *self.reducer.staging]),
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "ZeroOptimizer's buffers are fixed at construction; pass every group then"
        )

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer({type(self.inner).__name__}, {len(self.params)} params, "
            f"{len(self.layout.buckets)} buckets, dp={self.ctx.dp_size}, overlap={self.overlap})"
        )


class _Handle:
    """A forward pre-hook's handle that also forgets the hook in the optimizer's list."""

    def __init__(self, handle: RemovableHandle, registry: list[RemovableHandle]) -> None:
        self.handle, self.registry = handle, registry

    def remove(self) -> None:
        self.handle.remove()
        if self.handle in self.registry:
            self.registry.remove(self.handle)


def _takes_grad_scale(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` divides every gradient by ``opt.grad_scale`` (a 0-d tensor) in
    its own kernel: torch's fused optimizers (Adam, AdamW, SGD), as ``GradScaler`` drives them."""
    return (
        type(opt).__module__.startswith("torch.optim")
        and bool(opt.defaults.get("fused"))
        and bool(getattr(opt, "_step_supports_amp_scaling", False))
    )


def _check_passes(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {value!r}")
