"""How a :class:`~parallax.optim.zero.ZeroOptimizer` is put together: the layout and this
rank's buffers, the wrapped optimizer over its pieces, the gradient reduction of its stage and
ZeRO-3's gathers. A mixin, as the norm, weight and state methods are."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallax.optim.zero.bucketwise import StagedSteps
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.buffers.packing import build_layout, grad_homes
from parallax.optim.zero.offload.host_kernels import offloaded_buckets
from parallax.optim.zero.reduction.arrivals import GradArrivals
from parallax.optim.zero.reduction.bucket_reducer import GradReducer
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.weights.sharded_weights import Zero3, grouped_order, parameter_units


def check_offload(stage: int, offload: bool, fraction: float) -> None:
    if offload and stage < 2:
        raise ValueError(f"offloading the optimizer needs ZeRO stage 2 or 3, got {stage}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in (0, 1], got {fraction}")


class AssemblyMethods:
    """The constructor's parts (``self``: the ZeroOptimizer being built)."""

    ctx: Any
    stage: int

    def _build_buffers(self, got, modules: list[nn.Module], bucket_numel: int, offload: float):
        """The layout (by block at stage 3, by chunk at 2) and this rank's buffers, the first
        ``offload`` share of the elements offloaded."""
        self.units, unit_of = parameter_units(self.stage, modules, self.params)
        self.layout = build_layout(
            [tuple(p.shape) for p in self.params],
            [p.dtype for p in self.params],
            got.sequence_parallel,
            self.ctx.dp_size,
            bucket_numel,
            grouped_order(got.order, unit_of, len(self.params)),
            units=unit_of,
        )
        self.flat = FlatBuffers(
            self.params,
            self.layout,
            self.ctx.dp_rank,
            self.device,
            self._grad_homes(),
            self.stage,
            offloaded_buckets(self.layout, offload),
        )

    def _build_inner(self, optimizer_class, groups, group_of, optimizer_kwargs) -> None:
        """The wrapped optimizer over this rank's pieces, in the given groups."""
        members: list[list[torch.Tensor]] = [[] for _ in groups]  # this rank's pieces per group
        for pc, t in zip(self.flat.pieces, self.flat.piece_params):
            members[group_of[pc.param]].append(t)
        self.staged = StagedSteps(self.flat, [group_of[pc.param] for pc in self.flat.pieces])
        self._adopt(
            optimizer_class(
                [{"params": m, **g.options} for m, g in zip(members, groups)], **optimizer_kwargs
            )
        )

    def _build_reduction(self, passes: int, side_copies: bool) -> None:
        if self.stage >= 2:  # every backward pass reduced as it ends, no gradient buffer
            self.reducer = PassReducer(
                self.layout,
                self.flat.grad_outs,
                self.names,
                self.ctx,
                ordered=self.stage == 2,
                average=not self._fold,
                stream=self._stream,
                device=self.device,
            )
            self.reducer.passes = passes
            self.grads = GradArrivals(self.params, None, self.reducer, None)
            return
        self.reducer = GradReducer(
            self.layout,
            self.flat.grad_buffers,
            self.flat.grad_outs,
            self.names,
            self.ctx,
            self.overlap,
            passes,
            average=not self._fold,
            stream=self._stream,
        )
        copies = self._stream if side_copies and self.overlap else None
        self.grads = GradArrivals(self.params, self.flat.grad_views, self.reducer, copies)

    def _grad_homes(self) -> list[str]:
        """Where each bucket's fp32 reduced gradient lives (see ``buckets.grad_homes``)."""
        return grad_homes(self.layout, self.overlap, self.stage)

    def _build_zero3(self, bucket_numel: int, reshard_after_forward: bool) -> None:
        """Stage 3: the gathers of each unit's weights around its use (else ``None``)."""
        self.zero3 = None
        if self.stage == 3:
            self.zero3 = Zero3(
                self.units,
                self.params,
                self.flat.store,
                self.ctx,
                self.reducer,
                bucket_numel,
                reshard_after_forward,
            )
