"""One checkpoint file from every pipeline stage: the later stages' tensors reach the writer.

A format that is one file (LeRobot's policy folder holds one ``model.safetensors``) cannot be
written by pieces, one file per stage, as :mod:`parallax.models.hf_export` does. Here the
writer (global rank 0, on the first stage) writes its own stage's tensors, then receives every
later stage's from that stage's lead rank (dp 0, tp 0), one tensor at a time and in stage order,
over the pipeline group: no rank holds more than one whole tensor beyond its own parameters,
and the file is the one a single process writes (the same tensors in the same order). The
receiver sizes each buffer from the rows every stage announced beforehand
(:func:`stage_rows`). Every rank runs its own stage's tensors (their tp gathers), so a
generator of them may hold collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from parallax import comm

Row = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of one tensor in the file


def stage_rows(rows: list[Row], ctx: Any) -> list[list[Row]]:
    """Every pipeline stage's ``rows`` in stage order (``[rows]`` without a pipeline);
    collective over the pipeline group."""
    return comm.all_gather_object(rows, getattr(ctx, "pp_group", None))


def to_first_stage(
    tensors: Iterable[tuple[str, torch.Tensor]],
    ctx: Any,
    stages: list[list[Row]],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """On the first stage: ``tensors`` (this stage's), then on its lead rank every later
    stage's ``(name, tensor)`` as ``stages`` lists them. On a later stage: its lead rank sends
    each of ``tensors`` to the first stage's lead; nothing is yielded."""
    group = getattr(ctx, "pp_group", None)
    pp_rank = getattr(ctx, "pp_rank", 0) if group is not None else 0
    lead = group is not None and ctx.dp_rank == 0 and ctx.tp_rank == 0
    if pp_rank > 0:
        for _, t in tensors:
            if lead:
                comm.batch_send_recv([(t.contiguous(), ctx.pp_peer(0))], [], group)
        return
    yield from tensors
    if not lead:
        return
    for stage in range(1, len(stages)):
        for name, shape, dtype in stages[stage]:
            buf = torch.empty(shape, dtype=dtype, device=device)
            comm.batch_send_recv([], [(buf, ctx.pp_peer(stage))], group)
            yield name, buf
