"""How a :class:`~parallax.optim.zero.optimizer.ZeroOptimizer`'s parts are made, each from
what it needs: the layout of its stage, the wrapped optimizer over this rank's pieces and the
gradient reduction of its stage. Functions, so the optimizer reads as the list of its parts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.optim.zero.arguments import Accepted
from parallax.optim.zero.bucketwise import BucketwiseSteps
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.buffers.packing import FlatLayout, build_layout
from parallax.optim.zero.norms import StepScale, counted_pieces
from parallax.optim.zero.offload.host_steps import HostSteps
from parallax.optim.zero.reduction.arrivals import GradArrivals
from parallax.optim.zero.reduction.bucket_reducer import GradReducer
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.stage import ZeroStage
from parallax.optim.zero.torch_contract import takes_grad_scale
from parallax.optim.zero.weights.deferred_gathers import DeferredGathers
from parallax.optim.zero.weights.sharded_weights import ShardedWeights
from parallax.optim.zero.weights.units import Unit, grouped_order, parameter_units


def lay_out(
    stage: ZeroStage, modules: list[nn.Module], got: Accepted, dp: int, bucket_numel: int
) -> tuple[list[Unit], FlatLayout]:
    """The units (stage 3) and the layout of ``got``'s parameters: by block at stage 3, by
    chunk at 2, each unit's buckets its own."""
    units, unit_of = parameter_units(stage, modules, got.params)
    layout = build_layout(
        [tuple(p.shape) for p in got.params],
        [p.dtype for p in got.params],
        got.sequence_parallel,
        dp,
        bucket_numel,
        grouped_order(got.order, unit_of, len(got.params)),
        units=unit_of,
    )
    return units, layout


def wrap_pieces(
    optimizer_class: type[torch.optim.Optimizer],
    flat: FlatBuffers,
    got: Accepted,
    optimizer_kwargs: dict[str, Any],
) -> torch.optim.Optimizer:
    """The wrapped optimizer over this rank's pieces, in the groups given (their options)."""
    members: list[list[torch.Tensor]] = [[] for _ in got.groups]  # this rank's pieces per group
    for pc, t in zip(flat.pieces, flat.piece_params):
        members[got.group_of[pc.param]].append(t)
    groups = [{"params": m, **g.options} for m, g in zip(members, got.groups)]
    return optimizer_class(groups, **optimizer_kwargs)


def build_reduction(
    stage: ZeroStage,
    flat: FlatBuffers,
    names: Sequence[str],
    ctx: ParallelContext,
    *,
    overlap: bool,
    passes: int,
    average: bool,
    device: torch.device,
    stream: torch.cuda.Stream | None,
    copies: torch.cuda.Stream | None,
    sink: HostSteps | None,
    has: list[bool],
) -> tuple[GradReducer | PassReducer, GradArrivals]:
    """The stage's reducer and the gradient hooks that feed it: per pass into the shards
    (stages 2, 3; ``sink`` takes the offloaded buckets), or bucketed from the full gradient
    buffer (stage 1, which may copy fresh gradients into it on ``copies``); on ``device``, with
    the collectives on ``stream``. ``has``: which parameters got a gradient, set by the hooks."""
    if stage.reduces_each_pass:  # no gradient buffer: every backward pass reduced as it ends
        reducer: GradReducer | PassReducer = PassReducer(
            flat.layout,
            flat.grad_outs,
            names,
            ctx,
            ordered=stage.launches_in_order,
            average=average,
            stream=stream,
            device=device,
            passes=passes,
            sink=sink,
        )
        return reducer, GradArrivals(flat.params, None, reducer, None, has)
    reducer = GradReducer(
        flat.layout,
        flat.grad_buffers,
        flat.grad_outs,
        names,
        ctx,
        overlap,
        passes,
        average=average,
        stream=stream,
    )
    return reducer, GradArrivals(flat.params, flat.grad_views, reducer, copies, has)


@dataclass
class StepParts:
    """What a step goes through: the scales it owes (``scale``), the buckets stepped one at a
    time (``staged``), which pieces a norm counts, the host's steps (offloaded) and the
    gradient reduction with its hooks."""

    scale: StepScale
    staged: BucketwiseSteps
    counted: list[bool]
    host: HostSteps | None
    reducer: GradReducer | PassReducer
    grads: GradArrivals


def step_parts(
    stage: ZeroStage,
    flat: FlatBuffers,
    inner: torch.optim.Optimizer,
    names: Sequence[str],
    ctx: ParallelContext,
    device: torch.device,
    *,
    groups: list[int],
    offload: bool,
    early: bool,
    passes: int,
    overlap: bool,
    stream: torch.cuda.Stream | None,
    copies: torch.cuda.Stream | None,
    kept: Sequence[int] = (),
    one_pass: bool = False,
) -> StepParts:
    """The step's parts over ``flat`` (``groups``: each piece's parameter group; ``early``:
    the host steps each bucket during the backward)."""
    # torch's fused optimizers divide the gradients by ``grad_scale`` inside their kernel:
    # the dp average and the clip coefficient then cost no pass over the gradients
    fold = takes_grad_scale(inner) and not offload  # (host: scaled apart)
    counted = counted_pieces(flat.pieces, flat.params, ctx.tp_rank)
    has = [False] * len(flat.params)  # which parameters got a gradient since zero_grad()
    host = None
    if offload:
        host = HostSteps(flat, inner, ctx, device, groups, counted, has, early, kept, one_pass)
    reducer, grads = build_reduction(
        stage, flat, names, ctx, overlap=overlap, passes=passes, average=not fold,
        device=device, stream=stream, copies=copies, sink=host, has=has,
    )  # fmt: skip
    staged = BucketwiseSteps(flat, groups)
    return StepParts(StepScale(fold, ctx.dp_size, device), staged, counted, host, reducer, grads)


def weight_parts(
    stage: ZeroStage,
    units: list[Unit],
    params: Sequence[torch.Tensor],
    layout: FlatLayout,
    flat: FlatBuffers,
    ctx: ParallelContext,
    reducer: GradReducer | PassReducer,
    bucket_numel: int,
    reshard_after_forward: bool,
) -> tuple[DeferredGathers, ShardedWeights | None]:
    """The weights between steps: the all-gathers a forward may wait for (stages 1, 2), and at
    stage 3 the shards with their gathers around each use."""
    gathers = DeferredGathers(params, [s.bucket for s in layout.slots])
    if not stage.shards_weights:
        return gathers, None
    sharded = ShardedWeights(
        units, params, flat.store, ctx, reducer, bucket_numel, reshard_after_forward
    )
    return gathers, sharded
