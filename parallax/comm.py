"""The one place that calls ``torch.distributed`` collectives and point-to-point operations.

Every function takes the process group explicitly. ``group=None`` means *no communication*: the
axis has one member (or there is no process group at all), so the call is the identity. This is
how size-1 axes skip their collectives and how layers run in a plain single-process script.
Timeouts come from the groups, which :func:`parallax.init_parallel` creates with one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None
Work = object  # a torch.distributed work handle, or None: nothing to wait for

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# torch 2.13 renamed the tensor collectives; older releases (>= 2.4) only have the old names.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def size(group: Group) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Group) -> int:
    """This rank's index inside ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``. ``op`` is "sum", "avg", "max" or "min"."""
    if size(group) == 1:
        return tensor
    if op == "avg":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor.div_(size(group))
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: Group) -> Work | None:
    """Start an in-place sum over ``group``; pass the handle to :func:`wait` before reading
    ``tensor`` (``None``: nothing to wait for)."""
    if size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (all shapes equal)."""
    world = size(group)
    if world == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty(
        (world * moved.shape[0],) + tuple(moved.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    _all_gather_base(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(
    tensor: torch.Tensor, group: Group, dim: int = 0, op: str = "sum"
) -> torch.Tensor:
    """Reduce ``tensor`` across ``group`` and keep this rank's equal chunk along ``dim``."""
    world = size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world != 0:
        raise ValueError(
            f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} is not divisible by the "
            f"group size {world}"
        )
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty(
        (moved.shape[0] // world,) + tuple(moved.shape[1:]),
        dtype=tensor.dtype,
        device=tensor.device,
    )
    reduce_op = dist.ReduceOp.SUM if op in ("sum", "avg") else _OPS[op]
    _reduce_scatter_base(out, moved, op=reduce_op, group=group)
    if op == "avg":
        out.div_(world)
    return out.movedim(0, dim)


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    if size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_gather_object(obj: object, group: Group) -> list[object]:
    """Every rank's picklable ``obj``, in group order. Used for cheap agreement checks."""
    world = size(group)
    if world == 1:
        return [obj]
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def problems(problem: str | None, group: Group) -> list[str]:
    """Every rank's ``problem`` in ``group`` as ``"rank R: ..."`` (global ranks; the bare
    sentence in a group of one), the same list on every rank, empty when no rank has one.

    A check that one rank makes alone goes through here before the collectives that depend on
    it, so every rank raises instead of leaving the others waiting. When all is well this is
    one small all-reduce read by the host (on the CPU over gloo, on the current device
    otherwise); the sentences travel only when some rank has one.
    """
    return problems_and_max(problem, 0.0, group)[0]


def problems_and_max(problem: str | None, value: Any, group: Group) -> tuple[list[str], Any]:
    """:func:`problems`, and the largest ``value`` over the group in the same all-reduce (the
    step's wait for its batch: the step waits for the slowest rank's). ``value`` may be a
    tuple of floats (each reduced alike, a tuple returned): one host sync for them all."""
    many = isinstance(value, tuple)
    values = [float(v) for v in value] if many else [float(value)]
    if size(group) == 1:
        return ([] if problem is None else [problem]), (tuple(values) if many else values[0])
    device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
    flag = torch.tensor([float(problem is not None), *values], dtype=torch.float64, device=device)
    all_reduce(flag, group, op="max")
    found, *reduced = flag.tolist()
    largest = tuple(reduced) if many else reduced[0]
    if not found:
        return [], largest
    reports = all_gather_object((dist.get_rank(), problem), group)
    return [f"rank {r}: {p}" for r, p in reports if p is not None], largest


def barrier(group: Group) -> None:
    if size(group) > 1:
        dist.barrier(group=group)


def post_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: Group,
) -> list:
    """Post all ``(tensor, global_peer)`` sends and receives as one batch; return the works.

    Batching is what keeps two stages that face each other (both sending before receiving) from
    deadlocking: NCCL and gloo progress the whole batch together. Operations to one peer are
    matched in the order they are posted here (sends first, then receives).
    """
    if not sends and not recvs:
        return []
    first = (sends or recvs)[0][0]
    if first.device.type != "cpu" and dist.get_backend(group) == "gloo":
        # gloo would read the device pointer on the host and fail with an opaque socket error
        raise ValueError(
            f"gloo sends and receives CPU tensors only, got one on {first.device}: "
            "run pipeline parallelism on GPUs over NCCL"
        )
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    return list(dist.batch_isend_irecv(ops))


def batch_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: Group,
) -> None:
    """:func:`post_send_recv`, then wait for every operation."""
    for work in post_send_recv(sends, recvs, group):
        work.wait()


# -- flat-buffer collectives (ZeRO): write into a given output, optionally asynchronously ----------


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False
) -> Work | None:
    """Sum the flat ``input`` over ``group`` and write this rank's equal chunk into ``output``.

    ``output`` may be this rank's chunk of ``input`` (in place). Returns a work handle when
    ``async_op`` (``None`` when there is nothing to wait for); pass it to :func:`wait`.
    """
    if size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    return _reduce_scatter_base(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's flat ``input`` into ``output``, in group order.

    ``input`` may be this rank's chunk of ``output`` (in place, as NCCL allows; gloo copies).
    """
    if size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    return _all_gather_base(output, input, group=group, async_op=async_op)


def wait(work: Work) -> None:
    """Wait for a handle from an ``async_op`` call (a no-op for ``None``)."""
    if work is not None:
        work.wait()


@contextmanager
def side_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Issue the block's work on ``stream``, ordered after everything already issued on the
    current stream (``None``: the current stream, nothing changes).

    Only for blocks whose results are read through the handles of asynchronous collectives
    issued inside them: waiting on such a handle orders the waiting stream after the
    collective, which NCCL orders after the block's earlier work on ``stream``.
    """
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
