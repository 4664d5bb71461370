"""The conjugate communication operations of tensor parallelism, as autograd Functions.

Each takes the tp process group explicitly (``None``: a one-rank group, the identity both ways):

===================  ======================  =========================
function             forward                 backward
===================  ======================  =========================
copy_to_tp           identity                all-reduce
reduce_from_tp       all-reduce              identity
gather_from_tp       all-gather (``dim``)    keep own chunk
scatter_to_tp        keep own chunk          all-gather
gather_from_sp       all-gather (``dim``)    reduce-scatter
reduce_scatter_to_sp reduce-scatter          all-gather
===================  ======================  =========================

The last two are the sequence-parallel pair: activations outside the tp region are split along
the sequence dimension instead of replicated.

Under ``torch.compile`` the communicating calls run eagerly (:func:`parallax.eager.eager`): a
compiled block breaks its graph around each collective instead of tracing ``torch.distributed``.
With no group (one rank) they are the identity and compile away.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallax import comm
from parallax.comm import Group
from parallax.eager import eager

Op = Callable[[torch.Tensor, Group, int], torch.Tensor]  # one rank's side of a collective


def _chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = comm.size(group)
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} evenly over {world} tp ranks"
        )
    return x.chunk(world, dim=dim)[comm.rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return comm.all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: D102
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return comm.all_gather(x, group, dim=dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return comm.reduce_scatter(x, group, dim=dim).contiguous()


class _AlongDim(torch.autograd.Function):
    """One of the four pairs along ``dim`` in the module doc's table: ``op`` forward, its
    conjugate ``grad_op`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, op: Op, grad_op: Op):  # noqa: D102
        ctx.group, ctx.dim, ctx.grad_op = group, dim, grad_op
        return op(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return ctx.grad_op(grad, ctx.group, ctx.dim), None, None, None, None


@eager
def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: Group, *args) -> torch.Tensor:
    return x if comm.size(group) == 1 else fn.apply(x, group, *args)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tp region: identity forward, all-reduce of the gradient backward."""
    return x if group is None else _apply(_CopyToTP, x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a tp region by summing partial results: all-reduce forward, identity backward."""
    return x if group is None else _apply(_ReduceFromTP, x, group)


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate the tp ranks' pieces along ``dim``; backward keeps this rank's piece."""
    return x if group is None else _apply(_AlongDim, x, group, dim, _all_gather, _chunk)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's piece of ``x`` along ``dim``; backward all-gathers the gradient."""
    return x if group is None else _apply(_AlongDim, x, group, dim, _chunk, _all_gather)


def gather_from_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: all-gather the sequence pieces; backward reduce-scatters."""
    return x if group is None else _apply(_AlongDim, x, group, dim, _all_gather, _reduce_scatter)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: sum partial results and keep this rank's sequence piece."""
    return x if group is None else _apply(_AlongDim, x, group, dim, _reduce_scatter, _all_gather)
