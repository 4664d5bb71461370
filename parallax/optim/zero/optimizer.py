"""ZeRO 1, 2 and 3: a wrapper that shards any torch optimizer's state over the data-parallel group.

Every dp rank holds the whole model (parameters and gradients, in flat per-dtype buffers the
parameters are views into) but keeps optimizer state for its own slice of each bucket only.
A step is: reduce-scatter the gradients over dp (fp32, averaged), step the wrapped optimizer on
this rank's fp32 master slice, all-gather the updated slices back into the model. Sharding is
within ``ctx.dp_group``; tp and pp peers hold different parameters and shard them separately.
At dp=1 with 16-bit parameters nothing is reduced, and each bucket's fp32 gradient is made
only while the optimizer steps that bucket (:mod:`parallax.optim.zero.bucketwise`).

``stage=2`` also shards the reduced gradients: no gradient buffer, each backward pass is
reduce-scattered into this rank's fp32 shard as it ends
(:mod:`parallax.optim.zero.reduction.pass_reducer` says why per pass). ``stage=3`` also shards the
weights, trainable and frozen, of the ``modules`` given: each block is gathered just before use and
released after (:mod:`parallax.optim.zero.weights.unit_gathers`,
:mod:`parallax.optim.zero.weights.sharded_weights`); the step updates shards only.

The parts: the layout and buffers (:mod:`~parallax.optim.zero.buffers.packing`,
:mod:`~parallax.optim.zero.buffers.flat_buffers`), gradients arriving
(:mod:`~parallax.optim.zero.reduction.arrivals`) and their reduction
(:mod:`~parallax.optim.zero.reduction.bucket_reducer`), the deferred all-gathers
(:mod:`~parallax.optim.zero.weights.deferred_gathers`), the agreement of the ranks
(:mod:`~parallax.optim.zero.plane`), state I/O (:mod:`~parallax.optim.zero.state_io`) and the
torch.optim protocol (:mod:`~parallax.optim.zero.torch_contract`, the one place that relies on torch
behaviour beyond its documented API)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.optim.zero.arguments import accept, check_passes
from parallax.optim.zero.assembly import AssemblyMethods, check_offload
from parallax.optim.zero.memory_report import MemoryReport, zero_memory
from parallax.optim.zero.norms import NormMethods
from parallax.optim.zero.offload.host_kernels import host_options
from parallax.optim.zero.offload.host_steps import HostSteps
from parallax.optim.zero.state_io import StateMethods
from parallax.optim.zero.torch_contract import OptimizerFacade, grad_scale, takes_grad_scale
from parallax.optim.zero.weights.deferred_gathers import DeferredGathers
from parallax.optim.zero.weights.sharded_weights import (
    WeightMethods,
    check_stage,
)

log = logging.getLogger(__name__)

DEFAULT_BUCKET_NUMEL = 25_000_000  # 50 MB of bf16 gradients per reduce-scatter


class ZeroOptimizer(AssemblyMethods, NormMethods, WeightMethods, StateMethods, OptimizerFacade):
    """Shard ``optimizer_class``'s state over ``ctx.dp_group``; see the module docstring.

    ``stage`` (1, 2 or 3) and ``modules``: the model chunks holding ``params``, needed at stage 3
    (whose weights are sharded: every parameter of theirs that requires a gradient must be in
    ``params``, the others are frozen) and at stage 2 optional (each backward pass then reduces only
    the chunks it ran). ``reshard_after_forward`` (stage 3): see
    :mod:`parallax.optim.zero.weights.unit_gathers`. At stages 2 and 3 ``overlap`` does not apply:
    every pass is reduced as it ends.

    ``offload`` (stages 2 and 3): the fp32 masters and the optimizer's state live in host
    memory and each bucket is stepped there once its ``backward_passes_per_step``-th pass is
    reduced; ``step_in_backward``: right then, during the backward (nothing may clip the
    gradients after it), else in ``step()``. ``offload_fraction``: the share of the elements
    offloaded, the first buckets reduced (the last layers: their host steps have the most
    backward left to hide under); the others stay on the device. See
    :mod:`parallax.optim.zero.offload.host_steps`.

    ``params``: parameters, param-group dicts, or ``(name, param)`` pairs (``named_parameters()``)
    or groups of them; names key the saved state. Parameters with ``requires_grad=False`` are
    left alone. Build it after the model has its final device and dtype: the parameters become
    views into the optimizer's buffers.

    ``overlap``: in a step opened by ``zero_grad()``, reduce-scatter a bucket from a backward hook
    as soon as each of its parameters has had ``backward_passes_per_step`` gradient accumulations
    (the micro-batches of a pipeline schedule times the accumulation steps). ``step()`` always
    completes the reduction, so fewer passes, unused parameters, a step begun without
    ``zero_grad()`` or ``overlap=False`` are all correct; more passes raise. Buckets go out in a
    fixed order, from the end of ``param_order`` (the order the forward pass uses the parameters,
    e.g. ``model.parameters()``; default: as given, groups concatenated), and a parameter without a
    gradient holds back its bucket and all later ones until ``step()``. The hooks' collectives share
    ``ctx.dp_group`` with the model's: a model that communicates over dp in its backward must build
    the same graph on every dp rank, or use overlap=False. With 16-bit parameters at dp >= 2,
    overlap keeps each bucket's fp32 reduced gradient in a persistent slice (4/dp bytes per
    parameter); without it, the fp32 result is written over the bucket's own 16-bit gradient bytes.
    At dp=1 no fp32 gradient outlives the step of its bucket (see
    :mod:`parallax.optim.zero.buffers.packing`, ``grad_homes``). Either way, after the reduction the
    ``.grad`` of 16-bit parameters holds unspecified values.

    On GPUs at dp >= 2 the reduction's copies and collectives run on a side stream; with one
    backward pass per step, so does the copy of each fresh gradient into the buffer
    (``side_stream_grad_copies``). Turn that off when gradients come out of CUDA graphs
    (torch.compile's reduce-overhead mode): their memory is reused by the next replay on the
    compute stream, which would not wait for a copy on another stream.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer],
        ctx: ParallelContext,
        *,
        stage: int = 1,
        modules: Iterable[nn.Module] | nn.Module | None = None,
        reshard_after_forward: bool = True,
        offload: bool = False,
        offload_fraction: float = 1.0,
        step_in_backward: bool = False,
        overlap: bool = True,
        backward_passes_per_step: int = 1,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        param_order: Iterable[torch.Tensor] | None = None,
        side_stream_grad_copies: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        self.ctx, self.overlap, self.stage = ctx, overlap, stage
        modules = check_stage(stage, modules)
        check_offload(stage, offload, offload_fraction)
        if offload:
            optimizer_kwargs = host_options(optimizer_class, optimizer_kwargs)
        # checked on this rank, then agreed on by the stage's dp x tp plane (a collective)
        got = accept(
            ctx, params, optimizer_class, backward_passes_per_step, bucket_numel, param_order
        )
        self.names, self.params, self.device = got.names, got.params, got.device
        self._group_names = got.group_names
        self._build_buffers(got, modules, bucket_numel, offload_fraction if offload else 0.0)
        self._build_inner(optimizer_class, got.groups, got.group_of, optimizer_kwargs)
        # GPUs at dp >= 2: staging copies, reduce-scatters and all-gathers beside the compute
        self._stream = (
            torch.cuda.Stream(self.device)
            if self.device.type == "cuda" and ctx.dp_size > 1
            else None
        )
        # torch's fused optimizers divide the gradients by ``grad_scale`` inside their kernel:
        # the dp average and the clip coefficient then cost no pass over the gradients
        self._fold = takes_grad_scale(self.inner) and not offload  # (host: scaled apart)
        self._side_copies = side_stream_grad_copies
        self._coefs: list[torch.Tensor] = []  # clip coefficients, for staged buckets
        self._unscale: torch.Tensor | None = None  # clip coefficients folded into the step
        self._flags: list[bool] | None = None  # the dp-global "got a gradient", once reduced
        self._build_reduction(backward_passes_per_step, side_stream_grad_copies)
        self.host = HostSteps(self, got.group_of, step_in_backward) if offload else None
        self.reducer.sink = self.host
        self.gathers = DeferredGathers(self.params, [s.bucket for s in self.layout.slots])
        self._build_zero3(bucket_numel, reshard_after_forward)
        log.debug("%r: %s", self, self.memory_report())

    @torch.no_grad()
    def reload_master_weights(self) -> None:
        """Copy the model's current parameter values into the fp32 masters (no communication).

        Call it after writing weights into the model behind the optimizer's back; otherwise, for
        non-fp32 parameters, the masters are the truth and the next step overwrites them.
        """
        self.wait_params()
        self.flat.reload_masters()

    @property
    def backward_passes_per_step(self) -> int:
        return self.reducer.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, value: int) -> None:
        """Counts from the next gradient on; set it between steps (a change in the middle of
        one raises at the next gradient if that gradient's bucket already went out)."""
        check_passes(value)
        self.reducer.passes = value

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def _reduce(self) -> list[bool]:
        """Finish the gradient reduction (once per step); which parameters got a gradient on
        any dp rank."""
        if self._flags is None:
            self.grads.reattach()
            self.reducer.finish()
            self._flags = self.grads.global_flags(self.ctx.dp_group, self.device)
        return self._flags

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
        if self.host is not None:  # on the host, bucket by bucket (some maybe done already)
            self.host.step(flags)
        self._step_inner(flags)  # the buckets on the device
        self.gathers.works = self.flat.gather_params(
            self.ctx.dp_group, flags, wait=not self.gathers.deferred, stream=self._stream
        )
        if self.zero3 is not None:  # gathered weights are the old ones: back to the shards
            self.zero3.gathers.release_all()
        self._end_step(open=False)
        return loss

    def _step_inner(self, flags: list[bool]) -> None:
        stepped = False  # pieces whose fp32 gradient already has its home: one step for all
        for pc, t, g in zip(self.flat.pieces, self.flat.piece_params, self.flat.piece_grads):
            t.grad = g if g is not None and flags[pc.param] else None
            stepped = stepped or g is not None
        with self._grad_scale():
            if stepped:
                self.inner.step()
            self.staged.step(self.inner, flags, self._coefs)  # the others, bucket by bucket

    def _end_step(self, open: bool) -> None:
        self.reducer.reset(open)
        if self.host is not None:
            self.host.wait()
            self.host.reset()
        self._flags, self._coefs, self._unscale = None, [], None

    def _grad_scale(self):
        """When the wrapped optimizer folds scales, the reduced gradients hold dp sums, not yet
        clipped: let it divide them by ``dp / clip coefficients`` inside its kernel."""
        dp = self.ctx.dp_size
        if not self._fold or (dp == 1 and self._unscale is None):
            return nullcontext()
        if self._unscale is None:
            return grad_scale(self.inner, torch.full((), float(dp), device=self.device))
        return grad_scale(self.inner, dp / self._unscale)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients and accumulation, and open the next step (the buckets
        of an opened step are reduced during the backward, with ``overlap``).

        With ``set_to_none`` (the default) ``.grad`` becomes None, as in torch: the backward
        pass's first gradient is then copied into the parameter's view of the gradient buffer
        (one pass over it instead of zeroing and adding). Otherwise ``.grad`` stays a zeroed
        view. Whether a parameter got a gradient is tracked by hooks either way. Call it on
        every rank between steps: after ``step()`` (and, for 16-bit parameters, after
        ``grad_norm()``), gradients hold unspecified (partly reduced) values. Called in the
        middle of an opened step instead (after ``zero_grad()``, before ``grad_norm()`` or
        ``step()``), it first makes the step's remaining reduce-scatters on every rank, so the
        ranks' collectives stay aligned whatever each of them launched.
        """
        self.reducer.discard()
        self._end_step(open=True)
        self.grads.clear(self.flat.grad_buffers, set_to_none)

    # -- the parameter all-gather under the next forward ------------------------------------------
    def overlap_param_gather(self, *modules: nn.Module) -> list:
        """Let each step's all-gather of the updated parameters run under the next forward.

        ``step()`` then returns with the all-gathers in flight, launched in forward order, and a
        forward pre-hook on each of ``modules``' parameter holders (see
        :func:`parallax.optim.zero.weights.deferred_gathers.hook_points`) waits for the buckets it
        reads. Every parameter must be read inside the forward of a module that holds it (or of a
        compiled ancestor), not through another module's attribute. Anything else that reads
        parameters between ``step()`` and the next forward calls :meth:`wait_params` first; this
        optimizer's own methods do. Returns the hooks' handles; removing them all turns the deferral
        off again. At stage 3 there is nothing to defer (every use gathers): []."""
        if self.stage == 3:
            return []
        return self.gathers.register(modules)

    def wait_params(self) -> None:
        """Finish every parameter all-gather still in flight (see :meth:`overlap_param_gather`):
        call it before reading parameters outside a hooked forward, e.g. to save or evaluate."""
        self.gathers.wait_all()

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, measured from the tensors, and what plain AdamW would need."""
        return zero_memory(self)

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer({type(self.inner).__name__}, {len(self.params)} params, "
            f"{len(self.layout.buckets)} buckets, dp={self.ctx.dp_size}, stage={self.stage}, "
            f"overlap={self.overlap})"
        )
