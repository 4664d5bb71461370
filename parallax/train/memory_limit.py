"""``--gpu-memory-limit GIB``: a cap on this process's GPU memory, and what to say when a step
runs out of it; and the caching allocator's setting that every run starts with.

The cap is torch's per-process memory fraction (the caching allocator refuses to grow past it),
computed from the device's total memory: it emulates a smaller card on a large one (a 24 GiB
RTX 4090 on an H200) and keeps a shared GPU's other tenants safe. On the CPU it does nothing
but say so.
"""

from __future__ import annotations

import logging
import os

import torch

from parallax.context import ParallelContext
from parallax.run import TrainConfig

log = logging.getLogger(__name__)

GiB = 2**30
ALLOCATOR = "expandable_segments:True"


def default_allocator() -> None:
    """Expandable segments for torch's caching allocator unless ``PYTORCH_CUDA_ALLOC_CONF`` says
    otherwise (read when CUDA first allocates, so before any tensor is on the GPU). Segments
    that grow in place leave little of a card unusable between blocks of different sizes; the
    planner's allocator reserve (:mod:`parallax.plan.machine`) assumes them."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)


def apply_gpu_memory_limit(cfg: TrainConfig, ctx: ParallelContext) -> None:
    """Cap this process's GPU memory at ``cfg.gpu_memory_limit`` GiB (no collective: every rank
    checks its own device, and a cap larger than the device is a ``ValueError``)."""
    limit = cfg.gpu_memory_limit
    if limit is None:
        return
    if ctx.device.type != "cuda":
        if ctx.rank == 0:
            log.info("--gpu-memory-limit %g GiB: no GPU on this run, nothing to cap", limit)
        return
    total = cap_gpu_memory(limit, ctx.device)
    if ctx.rank == 0:
        log.info("GPU memory capped at %g GiB of %.1f GiB per process", limit, total / GiB)


def cap_gpu_memory(limit: float | None, device: torch.device) -> int:
    """Cap this process's allocator on ``device`` at ``limit`` GiB (``None``: lift the cap);
    returns the device's bytes. A cap larger than the device is a ``ValueError``."""
    if device.index is None:  # torch's cap wants an index; "cuda" means the current device
        device = torch.device(device.type, torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if limit is not None and limit * GiB > total:
        raise ValueError(
            f"--gpu-memory-limit {limit:g} GiB is more than this GPU's {total / GiB:.1f} GiB"
        )
    fraction = 1.0 if limit is None else limit * GiB / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return total


def out_of_memory_message(cfg: TrainConfig, step: int, err: BaseException) -> str:
    """What a user reads when step ``step`` ran out of GPU memory: the cap, the step, and the
    options of this run that would help."""
    cap = (
        f" under --gpu-memory-limit {cfg.gpu_memory_limit:g} GiB"
        if cfg.gpu_memory_limit is not None
        else ""
    )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    helps = []
    if cfg.zero < 3:
        helps.append(f"--zero 3 (now {cfg.zero}: shards the weights over dp too)")
    if cfg.offload == "none":
        helps.append("--offload optimizer (fp32 masters and AdamW moments in host memory)")
    if not cfg.activation_checkpointing:
        helps.append("--activation-checkpointing")
    if cfg.micro_batch_size > 1:
        helps.append(f"a smaller --micro-batch-size (now {cfg.micro_batch_size})")
    advice = "; ".join(helps) if helps else "more GPUs (a larger --dp, --tp or --pp)"
    return f"step {step} ran out of GPU memory{cap} ({first}). What would help: {advice}"
