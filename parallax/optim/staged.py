"""Stepping the wrapped optimizer a run of buckets at a time, in the forward pass's order.

``step()`` steps the buckets in *runs*: consecutive buckets in forward order (the last bucket
holds the first layers), each run one call of the wrapped optimizer with its groups narrowed to
the run's pieces. After a run, its buckets are handed on (to their all-gather), so the next
forward can start on the first layers while the optimizer still steps the last ones. Torch
optimizers skip parameters whose ``.grad`` is None and keep their state per parameter (AdamW's
step count included), so stepping run by run updates every piece exactly as one step over all
of them would, with its own group's hyperparameters. The wrapped optimizer must not keep state
across parameters (none of ``torch.optim`` does, LBFGS aside), and hooks registered on it run
once per run.

A staged bucket (dp=1, 16-bit parameters: see :func:`~parallax.optim.buckets.grad_homes`) keeps
no fp32 gradient between steps and is a run of its own: ``step()`` makes its fp32 gradient in
one reused buffer, its master pieces get a ``.grad`` (views of the buffer) for the call, and
the ``.grad`` goes back to None. Other buckets join a run until it holds ``run_numel`` elements
of this rank: few calls (each costs host time), yet an early first hand-on.

For each call the wrapped optimizer's groups are narrowed to the run's pieces, so a call costs
in proportion to the run, not the model: the group dicts, their hyperparameters and the state
stay the same objects; only each group's ``"params"`` list is swapped for the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from parallax.optim.buckets import STAGED
from parallax.optim.flat import FlatBuffers

DEFAULT_RUN_NUMEL = 100_000_000  # this rank's elements per optimizer call (~1 ms of fused AdamW)


@contextmanager
def narrowed(inner: torch.optim.Optimizer, members: Sequence[list[torch.Tensor]]) -> Iterator[None]:
    """Let ``inner``'s group ``j`` hold only ``members[j]`` for the duration."""
    groups = inner.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g, m in zip(groups, members):
            g["params"] = m
        yield
    finally:
        for g, s in zip(groups, saved):
            g["params"] = s


@dataclass(frozen=True)
class Run:
    buckets: tuple[int, ...]  # in forward order
    pieces: tuple[int, ...]  # indices into flat.pieces
    staged: bool


def plan_runs(flat: FlatBuffers, run_numel: int) -> list[Run]:
    """The runs of ``flat``'s buckets in forward order (pure: from the layout and homes)."""
    pieces_of: dict[int, list[int]] = {}
    for k, pc in enumerate(flat.pieces):
        pieces_of.setdefault(pc.bucket, []).append(k)
    runs: list[Run] = []
    buckets: list[int] = []
    pieces: list[int] = []
    numel = 0
    for b in reversed(range(len(flat.layout.buckets))):
        if flat.homes[b] == STAGED:
            if buckets:
                runs.append(Run(tuple(buckets), tuple(pieces), False))
                buckets, pieces, numel = [], [], 0
            runs.append(Run((b,), tuple(pieces_of.get(b, ())), True))
            continue
        buckets.append(b)
        pieces += pieces_of.get(b, ())
        numel += flat.layout.buckets[b].chunk
        if numel >= run_numel:
            runs.append(Run(tuple(buckets), tuple(pieces), False))
            buckets, pieces, numel = [], [], 0
    if buckets:
        runs.append(Run(tuple(buckets), tuple(pieces), False))
    return runs


class BucketSteps:
    """How to step the pieces of one :class:`FlatBuffers`, run by run."""

    def __init__(
        self, flat: FlatBuffers, piece_groups: Sequence[int], run_numel: int = DEFAULT_RUN_NUMEL
    ) -> None:
        self.flat, self.piece_groups = flat, piece_groups  # group index of each piece
        self.runs = plan_runs(flat, run_numel)
        self.has_staged = any(run.staged for run in self.runs)

    @torch.no_grad()
    def step(
        self,
        inner: torch.optim.Optimizer,
        flags: Sequence[bool],
        coefs: Sequence[torch.Tensor],
        stepped: Callable[[int], None] | None = None,
    ) -> None:
        """Step every piece whose parameter has a gradient (``flags``), run by run; after each
        run, call ``stepped(bucket)`` for its buckets in forward order. Staged gradients are
        scaled by the clip coefficients ``coefs`` as they are made."""
        flat = self.flat
        for run in self.runs:
            live = [k for k in run.pieces if flags[flat.pieces[k].param]]
            if live:
                if run.staged:
                    stage = flat.stage(run.buckets[0], coefs)  # (bucket,) fp32
                    for k in live:
                        pc = flat.pieces[k]
                        flat.piece_params[k].grad = stage[
                            pc.chunk_offset : pc.chunk_offset + pc.numel
                        ]
                else:
                    for k in live:
                        flat.piece_params[k].grad = flat.piece_grads[k]
                members: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
                for k in live:
                    members[self.piece_groups[k]].append(flat.piece_params[k])
                try:
                    with narrowed(inner, members):
                        inner.step()
                finally:
                    for k in live:
                        flat.piece_params[k].grad = None
            if stepped is not None:
                for b in run.buckets:
                    stepped(b)
