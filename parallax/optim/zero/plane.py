"""Agreement within one pipeline stage's dp x tp plane, the ranks that ZeRO's collectives span.

A stage's ZeroOptimizer reduces over its dp group and, for sequence-parallel buckets, its tp
group: every rank of the plane must build the same buffers, and a problem that one rank finds
alone must stop all of them, or the others wait in a collective until the timeout.
:func:`plane_gather` brings every rank's value to every rank of the plane (an object
all-gather over dp, then one of the gathered lists over tp), so each rank computes the same
verdict from the same data.
"""

from __future__ import annotations

from typing import Any

from parallax import comm
from parallax.context import ParallelContext


def plane_gather(ctx: ParallelContext, value: Any) -> list[list[Any]]:
    """``[tp_rank][dp_rank] -> value`` over this stage's plane, the same on each of its ranks."""
    column = comm.all_gather_object(value, ctx.dp_group)
    return comm.all_gather_object(column, ctx.tp_group)


def _difference(axis: str, a: tuple, ra: int, b: tuple, rb: int) -> str:
    (_, dev_a, sig_a), (_, dev_b, sig_b) = a, b
    if dev_a != dev_b:
        return f"parameters on {dev_a} on rank {ra} but on {dev_b} on rank {rb}"
    diff = next((i for i, (x, y) in enumerate(zip(sig_a, sig_b)) if x != y), None)
    what = (
        f"{len(sig_a)} vs {len(sig_b)} trainable parameters"
        if diff is None
        else f"parameter #{diff}: {sig_a[diff]} on rank {ra} vs {sig_b[diff]} on rank {rb}"
    )
    return (
        f"{axis} ranks disagree on the trainable parameters ({what}); every {axis} rank must pass "
        "the same names, shapes, dtypes, requires_grad and groups (name, shape, dtype, "
        "sequence_parallel, group)"
    )


def plane_problems(
    ctx: ParallelContext, problem: str | None, device_type: str, signature: list[tuple]
) -> list[str]:
    """What stops this stage's ZeroOptimizer, the same list on every rank of the plane (a
    collective): each rank's own ``problem``, else any disagreement between the ranks on the
    device type or the ``signature`` of the trainable parameters."""
    plane = plane_gather(ctx, (ctx.rank, problem, device_type, signature))
    reports = [r for column in plane for r in column]
    many = len(reports) > 1
    found = [f"rank {r}: {p}" if many else p for r, p, *_ in reports if p is not None]
    if found:
        return found
    first = plane[0][0]
    for column in plane:
        for axis, ref, other in [("tp", first, column[0])] + [("dp", column[0], x) for x in column]:
            if ref[2:] != other[2:]:
                return [_difference(axis, ref[1:], ref[0], other[1:], other[0])]
    return []
