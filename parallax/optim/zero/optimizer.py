"""ZeRO 1, 2 and 3: a wrapper that shards any torch optimizer's state over the data-parallel group.

Every dp rank holds the whole model (parameters and gradients, in flat per-dtype buffers the
parameters are views into) but keeps optimizer state for its own slice of each bucket only.
A step is: reduce-scatter the gradients over dp (fp32, averaged), step the wrapped optimizer on
this rank's fp32 master slice, all-gather the updated slices back into the model. Sharding is
within ``ctx.dp_group``; tp and pp peers hold different parameters and shard them separately.
Stages 2 and 3 shard the reduced gradients and the weights too
(:mod:`~parallax.optim.zero.stage`). The optimizer is made of parts, each given what it reads
(:mod:`parallax.optim.zero` lists them); this module puts them together and asks them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.optim.zero.arguments import accept, check_passes
from parallax.optim.zero.assembly import lay_out, step_parts, weight_parts, wrap_pieces
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.buffers.homes import grad_homes
from parallax.optim.zero.buffers.packing import DEFAULT_BUCKET_NUMEL
from parallax.optim.zero.memory_report import MemoryReport, measure
from parallax.optim.zero.norms import clip_coefficient, global_grad_norm
from parallax.optim.zero.offload.options import OffloadOptions
from parallax.optim.zero.stage import stage_of
from parallax.optim.zero.state_io import StateIO
from parallax.optim.zero.torch_contract import OptimizerFacade, narrowed
from parallax.optim.zero.weights_and_state import WeightsAndState

log = logging.getLogger(__name__)


class ZeroOptimizer(WeightsAndState, OptimizerFacade):
    """Shard ``optimizer_class``'s state over ``ctx.dp_group``; see the module docstring.

    ``stage`` (1, 2 or 3: :class:`~parallax.optim.zero.stage.ZeroStage`) and ``modules``: the model
    chunks holding ``params``, needed at stage 3 (whose weights are sharded: every parameter of
    theirs that requires a gradient must be in ``params``, the others are frozen) and at stage 2
    optional (each backward pass then reduces only the chunks it ran). ``reshard_after_forward``
    (stage 3): see :mod:`parallax.optim.zero.weights.unit_gathers`. At stages 2 and 3 ``overlap``
    does not apply: every pass is reduced as it ends.

    ``offload`` (stages 2 and 3: the fp32 masters and the optimizer's state in host memory),
    ``offload_fraction``, ``gpu_accumulation``, ``host_adamw``, ``host_masters`` and
    ``step_in_backward``: :mod:`parallax.optim.zero.offload.options` says what each means.

    ``params``: parameters, param-group dicts, or ``(name, param)`` pairs (``named_parameters()``)
    or groups of them; names key the saved state. Parameters with ``requires_grad=False`` are
    left alone. Build it after the model has its final device and dtype: the parameters become
    views into the optimizer's buffers.

    ``overlap``: in a step opened by ``zero_grad()``, reduce-scatter each bucket from a backward
    hook once its parameters have had ``backward_passes_per_step`` accumulations, in a fixed
    order from the end of ``param_order`` (the forward's order; default: as given); ``step()``
    always completes the reduction, so fewer passes, unused parameters or ``overlap=False`` are
    all correct, more passes raise (:mod:`~parallax.optim.zero.reduction.bucket_reducer` says
    what every rank launches, and where each fp32 reduced gradient lives). After the reduction
    the ``.grad`` of 16-bit parameters holds unspecified values.

    ``side_stream_grad_copies``: on GPUs at dp >= 2 with one backward pass per step, copy each
    fresh gradient into the buffer on the reduction's side stream. Turn it off when gradients
    come out of CUDA graphs: the next replay on the compute stream would not wait for the copy.
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
        gpu_accumulation: float = 0.0,
        host_adamw: str = "torch",
        host_masters: str = "full",
        step_in_backward: bool = False,
        overlap: bool = True,
        backward_passes_per_step: int = 1,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        param_order: Iterable[torch.Tensor] | None = None,
        side_stream_grad_copies: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        self.ctx, self.overlap, self.stage = ctx, overlap, stage_of(stage)
        modules = self.stage.check_modules(modules)
        offloading = OffloadOptions(
            offload, offload_fraction, gpu_accumulation, host_adamw, host_masters, step_in_backward
        )
        optimizer_kwargs = offloading.checked(self.stage, optimizer_class, optimizer_kwargs)
        # checked on this rank, then agreed on by the stage's dp x tp plane (a collective)
        got = accept(
            ctx, params, optimizer_class, backward_passes_per_step, bucket_numel, param_order
        )
        self.names, self.params, self.device = got.names, got.params, got.device
        self._group_names = got.group_names
        self.units, self.layout = lay_out(self.stage, modules, got, ctx.dp_size, bucket_numel)
        hosted, kept, split = offloading.buckets(self.layout)
        homes = self._grad_homes()
        self.flat = FlatBuffers(
            self.params, self.layout, ctx.dp_rank, self.device, homes, self.stage, hosted, split
        )
        self._adopt(wrap_pieces(optimizer_class, self.flat, got, optimizer_kwargs))
        # GPUs at dp >= 2: staging copies, reduce-scatters and all-gathers beside the compute
        beside = self.device.type == "cuda" and ctx.dp_size > 1
        self._stream = torch.cuda.Stream(self.device) if beside else None
        self._side_copies = side_stream_grad_copies
        self._defer_host = False  # the host's step left running under the next forward
        self._piece_groups = groups = [got.group_of[pc.param] for pc in self.flat.pieces]
        self._build_step(groups, offloading, backward_passes_per_step, kept)
        self._build_weights(bucket_numel, reshard_after_forward)
        self.state_io = StateIO(
            self.names, self.params, self._group_names, self.flat, self.inner, ctx, self.device
        )
        log.debug("%r: %s", self, self.memory_report())

    def _build_step(
        self, groups: list[int], offloading: OffloadOptions, passes: int, kept: list[int]
    ) -> None:
        """The parts a step goes through (:func:`~parallax.optim.zero.assembly.step_parts`)."""
        copies = self._stream if self._side_copies and self.overlap else None
        parts = step_parts(
            self.stage, self.flat, self.inner, self.names, self.ctx, self.device,
            groups=groups, offload=offloading.offload, early=offloading.early, passes=passes,
            overlap=self.overlap, kept=kept, one_pass=offloading.host_adamw == "one-pass",
            stream=self._stream, copies=copies,
        )  # fmt: skip
        self.scale, self.staged, self._counted = parts.scale, parts.staged, parts.counted
        self.host, self.reducer, self.grads = parts.host, parts.reducer, parts.grads
        self._flags: list[bool] | None = None  # the dp-global "got a gradient", once reduced

    def _build_weights(self, bucket_numel: int, reshard_after_forward: bool) -> None:
        """The weights between steps (:func:`~parallax.optim.zero.assembly.weight_parts`)."""
        self.gathers, self.zero3 = weight_parts(
            self.stage, self.units, self.params, self.layout, self.flat, self.ctx, self.reducer,
            bucket_numel, reshard_after_forward,
        )  # fmt: skip

    def _grad_homes(self) -> list[str]:
        """Where each bucket's fp32 reduced gradient lives (a method: tests force others)."""
        return grad_homes(self.layout, self.overlap, self.stage)

    @property
    def _fold(self) -> bool:
        return self.scale.fold

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
            self.host.step(flags, defer=self._defer_host)
        self._step_inner(flags)  # the buckets on the device
        works = self.flat.gather_params(
            self.ctx.dp_group, flags, wait=not self.gathers.deferred, stream=self._stream
        )
        if self._defer_host and self.zero3 is None:  # the hooks wait for the uploads too
            works.update(self.host.pending_uploads())
        self.gathers.track(works)
        if self.zero3 is not None:  # gathered weights are the old ones: back to the shards
            self.zero3.gathers.release_all()
        self._end_step(open=False)
        return loss

    def _step_inner(self, flags: list[bool]) -> None:
        """Step the buckets on the device. The offloaded ones are the host worker's, which may
        still be stepping them (``overlap_host_step``): their pieces are left out, ``.grad``
        included, and the optimizer is narrowed to the others."""
        stepped = False  # pieces whose fp32 gradient already has its home: one step for all
        members: list[list[torch.Tensor]] = [[] for _ in self.inner.param_groups]
        for k, (pc, t, g) in enumerate(
            zip(self.flat.pieces, self.flat.piece_params, self.flat.piece_grads)
        ):
            if pc.bucket in self.flat.offload:
                continue
            t.grad = g if g is not None and flags[pc.param] else None
            stepped = stepped or g is not None
            members[self._piece_groups[k]].append(t)
        mine = narrowed(self.inner, members) if self.host is not None else nullcontext()
        with self.scale.folded(self.inner), mine:
            if stepped:
                self.inner.step()
            self.staged.step(self.inner, flags, self.scale.coefs)  # the others, bucket by bucket

    def _end_step(self, open: bool) -> None:
        self.reducer.reset(open)
        if self.host is not None:  # (its step may still run under the next forward)
            self.host.end_step()
        self._flags = None
        self.scale.reset()

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

    # -- the gradient norm ---------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over dp, tp and pp (every rank must call it), from the
        reduced gradients (offloaded buckets: each one's share, taken on the host); reduces the
        gradients first if ``step()`` has not yet."""
        self._reduce()
        host = self.host.local_part(norm_type) if self.host is not None else 0.0
        skip = self.host.buckets if self.host is not None else ()  # offloaded: in ``host``
        counted = (  # staged buckets: their 16-bit gradients, the norm taken in fp32
            [g for k, g in group if self._counted[k]]
            for group in self.flat.reduced_grads_by_bucket(self.scale.coefs, True, skip)
        )
        total = global_grad_norm(counted, self.ctx, norm_type, self.device, host)
        return self.scale.true_norm(total)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the norm before.
        (Staged buckets are scaled when ``step()`` makes their fp32 gradients.)"""
        total = self.grad_norm(norm_type)
        coef = clip_coefficient(total, max_norm)
        if self.host is not None:
            self.host.clip(coef)  # (no folding when offloaded: the others are scaled below)
        self.scale.clip(coef, self.flat.grad_outs, bool(self.staged))
        return total

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, measured from the tensors, and what plain AdamW would need
        (after any step still running: its state is made)."""
        self.wait_params()
        return measure(
            self.flat, self.inner, self.params, self.stage, self.reducer, self.host, self.zero3
        )

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer({type(self.inner).__name__}, {len(self.params)} params, "
            f"{len(self.layout.buckets)} buckets, dp={self.ctx.dp_size}, stage={self.stage}, "
            f"overlap={self.overlap})"
        )
