"""Where each bucket's fp32 reduced gradient (this rank's chunk) lives between the reduction and
the optimizer step: :meth:`ZeroStage.grad_home <parallax.optim.zero.stage.ZeroStage.grad_home>`
of every bucket of a layout, which the flat buffers are built from. The choice is static, the
same on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallax.optim.zero.buffers.packing import FlatLayout
from parallax.optim.zero.stage import HOMES, INPLACE, OWN, SHARD, STAGED, ZeroStage

__all__ = ["HOMES", "INPLACE", "OWN", "SHARD", "STAGED", "check_homes", "grad_homes"]


def grad_homes(layout: FlatLayout, overlap: bool, stage: ZeroStage) -> list[str]:
    """Each bucket's :meth:`ZeroStage.grad_home` (``overlap``: stage 1 may reduce it during the
    backward)."""
    homes = []
    for b in layout.buckets:
        dtype = layout.dtypes[b.buffer]
        fp32, partial = dtype == torch.float32, b.sequence_parallel
        homes.append(
            stage.grad_home(dtype.itemsize, fp32, layout.dp, partial=partial, overlap=overlap)
        )
    return homes


def check_homes(layout: FlatLayout, homes: Sequence[str], stage: ZeroStage) -> None:
    """Reject homes that cannot hold a bucket's reduced gradient (an internal consistency
    check: :func:`grad_homes` never makes them)."""
    if len(homes) != len(layout.buckets):
        raise ValueError(f"{len(homes)} gradient homes for {len(layout.buckets)} buckets")
    if not stage.full_grad_buffer:
        if any(home != SHARD for home in homes):
            raise ValueError(f"ZeRO-{stage} keeps every bucket's gradient in a {SHARD!r} slice")
        return
    for b, home in zip(layout.buckets, homes):
        fp32 = layout.dtypes[b.buffer] == torch.float32
        bad = (
            home not in HOMES
            or (home == OWN and not fp32)  # only fp32 gradients are their own fp32 home
            or (fp32 and home not in (OWN, STAGED))
            or (home == INPLACE and layout.dp * layout.dtypes[b.buffer].itemsize < 4)
            or (home == STAGED and (layout.dp != 1 or b.sequence_parallel))
        )
        if bad:
            raise ValueError(
                f"bucket {b.index} ({layout.dtypes[b.buffer]}, dp={layout.dp}, "
                f"sequence_parallel={b.sequence_parallel}) cannot keep its gradient {home!r}"
            )
