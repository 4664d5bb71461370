"""Timing one configuration of the OpenVLA step benchmark on this rank: the step times, the
first and the last loss, and the gloo control messages and memory hygiene between rows."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from benchmarks.tools.common import sync


@dataclass
class Measured:
    """This rank's view of one configuration (bubbles only on rank 0 of a pipeline):
    ``first_loss`` is the first step's, from the initial weights (the same in every row)."""

    step_times: list[float]
    peak_gib: float
    loss: float
    first_loss: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)


def time_steps(
    step: Callable[[], object], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], float, float]:
    """Seconds per step after ``warmup`` steps, the first step's loss and the last one (both
    read after timing: the first is kept as a copy made on the device, no host sync).

    On a GPU a step's time is the interval between its start and the next step's start on the
    compute stream (CUDA events, one synchronisation at the end): the steady-state time per
    step, which counts work a step leaves in flight for the next one (parallax's deferred
    all-gathers, FSDP2's prefetches) where it really lands. Elsewhere, wall time with a
    synchronisation after each step."""
    out, first = None, []

    def run() -> object:
        out = step()
        if not first:  # a copy: a CUDA-graph replay may reuse the output's memory
            first.append(_loss(out).detach().clone())
        return out

    for _ in range(warmup):
        out = run()
    sync(device)
    times = []
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        for k in range(steps):
            marks[k].record()
            out = run()
        marks[steps].record()
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        for _ in range(steps):
            start = time.perf_counter()
            out = run()
            sync(device)
            times.append(time.perf_counter() - start)
    last = math.nan if out is None else float(_loss(out).detach())
    return times, float(first[0]) if first else math.nan, last


def _loss(out) -> torch.Tensor:
    """The loss of a step's output: a dict (natives) or parallax's ``StepOutput``."""
    return out["loss"] if isinstance(out, dict) else out.loss


def gather(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``obj`` over the gloo control group (``None``: one process). Control
    messages never share a communicator with the frameworks' own NCCL collectives, so a rank
    that failed mid-step cannot match them against a peer's pending gradient reduction."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def free_memory(device: torch.device, reset_peak: bool = False) -> None:
    gc.collect()
    if device.type == "cuda":
        # compiled code and its CUDA-graph trees keep the graphs' memory pools alive: after a
        # --cuda-graphs row the next configuration ran out of memory without this
        reset = getattr(torch.compiler, "reset", None)
        if reset is not None:
            reset()
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        except ImportError:
            pass
        else:
            reset_cudagraph_trees()
        gc.collect()
        torch.cuda.empty_cache()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
