"""Forward-only pipelining for evaluation: every microbatch through every stage, no backward.

Evaluation needs no schedule to overlap anything: the microbatches walk the stages in one global
order, ``(microbatch 0, stage 0), (0, 1), ..., (1, 0), ...``, and each rank does only the steps
it holds, receiving a stage's input from the rank of the stage before and sending its output to
the rank of the stage after. Every rank walks the same order, so each send meets its receive in
the same position on both peers and nothing can deadlock, with any placement (interleaved
chunks included). It runs under ``torch.no_grad``; nothing is kept between microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.pipeline.p2p import TensorMeta, as_tensors
from parallax.pipeline.schedule import Schedule

RecvMetas = Callable[[int, int], Sequence[TensorMeta]]


def _call(module: torch.nn.Module, args: Any) -> Any:
    if isinstance(args, dict):
        return module(**args)
    if isinstance(args, tuple | list):
        return module(*args)
    return module(args)


def _exchange(sends: list, recvs: list, ctx: ParallelContext) -> None:
    for work in comm.post_send_recv(sends, recvs, ctx.pp_group):
        work.wait()


@torch.no_grad()
def run_forward(
    schedule: Schedule,
    modules: dict[int, torch.nn.Module],
    ctx: ParallelContext,
    inputs: Sequence | None,
    last: Callable[[Any, int], Any],
    recv_metas: RecvMetas,
) -> list[Any]:
    """Run every microbatch forward; return ``last(output, microbatch)`` for each microbatch on
    the rank holding the last stage (an empty list elsewhere).

    ``modules`` maps this rank's virtual stages to their chunks; ``inputs[m]`` is the first
    stage's input; ``recv_metas(stage, m)`` the tensors ``stage`` receives (exact shapes)."""
    rank, device = ctx.pp_rank, ctx.device
    results: list[Any] = []
    for m in range(schedule.num_microbatches):
        carried: tuple[torch.Tensor, ...] | None = None  # output of the previous stage, if local
        for s in range(schedule.num_stages):
            here = schedule.rank_of(s) == rank
            prev = schedule.rank_of(s - 1) if s else None
            if here and s > 0 and prev != rank:  # the input comes from another rank
                bufs = [meta.empty(device) for meta in recv_metas(s, m)]
                _exchange([], [(b, ctx.pp_peer(prev)) for b in bufs], ctx)
                carried = tuple(bufs)
            if not here:
                if s > 0 and prev == rank and carried is not None:  # ours goes to its rank
                    peer = ctx.pp_peer(schedule.rank_of(s))
                    _exchange([(t.contiguous(), peer) for t in carried], [], ctx)
                carried = None
                continue
            args = inputs[m] if s == 0 else carried
            out = _call(modules[s], args)
            if s == schedule.num_stages - 1:
                results.append(last(out, m))
            else:
                carried = as_tensors(out, f"stage {s}")
    return results
