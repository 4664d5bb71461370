"""Stepping the wrapped optimizer one staged bucket at a time.

A staged bucket (dp=1, 16-bit parameters: see
:meth:`~parallax.optim.zero.stage.ZeroStage.grad_home`) keeps no fp32 gradient between steps.
``step()`` makes it in one reused buffer right before the optimizer steps that bucket: only the
bucket's master pieces get a ``.grad`` (views of the buffer), the wrapped optimizer steps, and their
``.grad`` goes back to None. Torch optimizers skip parameters whose ``.grad`` is None and keep their
state per parameter (AdamW's step count included), so stepping bucket by bucket updates every piece
exactly as one step over all of them would, with its own group's hyperparameters. The wrapped
optimizer must not keep state across parameters (none of ``torch.optim`` does, LBFGS aside), and
hooks registered on it run once per bucket.

For each call the wrapped optimizer's groups are narrowed to the bucket's pieces
(:func:`parallax.optim.zero.torch_contract.narrowed`), so a call costs in proportion to the bucket,
not the model: the group dicts, their hyperparameters and the state stay the same objects; only each
group's ``"params"`` list is swapped for the call."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.buffers.homes import STAGED
from parallax.optim.zero.torch_contract import narrowed


def step_bucket(
    inner: torch.optim.Optimizer,
    flat: FlatBuffers,
    live: Sequence[int],
    grad: torch.Tensor,
    piece_groups: Sequence[int],
    scaled: AbstractContextManager | None = None,
) -> None:
    """Step the pieces ``live`` (indices of ``flat.pieces``, all of one bucket) on their parts of
    the bucket's fp32 gradient chunk ``grad``, each in its group (``piece_groups``), with the
    wrapped optimizer narrowed to them and inside ``scaled``; their ``.grad`` is None after.
    Staged buckets and the offload's host steps are stepped so."""
    if not live:
        return
    members: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
    for k in live:
        pc, t = flat.pieces[k], flat.piece_params[k]
        t.grad = grad[pc.chunk_offset : pc.chunk_offset + pc.numel]
        members[piece_groups[k]].append(t)
    try:
        with narrowed(inner, members), scaled or nullcontext():
            inner.step()
    finally:
        for k in live:
            flat.piece_params[k].grad = None


class BucketwiseSteps:
    """The staged buckets of one :class:`FlatBuffers` and how to step them."""

    def __init__(self, flat: FlatBuffers, piece_groups: Sequence[int]) -> None:
        self.flat, self.piece_groups = flat, piece_groups  # group index of each piece
        of_bucket: dict[int, list[int]] = {}
        for k, pc in enumerate(flat.pieces):
            if flat.homes[pc.bucket] == STAGED:
                of_bucket.setdefault(pc.bucket, []).append(k)
        self.buckets = sorted(of_bucket.items())  # (bucket, indices of its pieces), in order

    def __bool__(self) -> bool:
        return bool(self.buckets)

    @torch.no_grad()
    def step(
        self,
        inner: torch.optim.Optimizer,
        flags: Sequence[bool],
        coefs: Sequence[torch.Tensor],
    ) -> None:
        """Step every staged piece whose parameter has a gradient (``flags``), bucket by bucket,
        its gradient scaled by the clip coefficients ``coefs``."""
        flat = self.flat
        for b, ks in self.buckets:
            live = [k for k in ks if flags[flat.pieces[k].param]]
            if live:
                grad = flat.staged_grad(b, coefs)  # (bucket/dp,) fp32
                step_bucket(inner, flat, live, grad, self.piece_groups)
