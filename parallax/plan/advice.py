"""Under a memory cap, whether a run's layout fits, and which of its options would make it fit:
the ZeRO stage, offload, activation checkpointing and the micro-batch, alone or together, at the
same world size (``--dry-run`` prints it)."""

from __future__ import annotations

import dataclasses
import itertools

from parallax.dims import ParallelDims
from parallax.plan.layout import Layout
from parallax.plan.machine import Machine
from parallax.plan.memory import GIB, RankMemory, plan_memory
from parallax.plan.search import Searcher
from parallax.plan.workload import Workload
from parallax.run import TrainConfig

SHOWN = 4  # fitting alternatives printed


def cap_of(cfg: TrainConfig) -> tuple[float, str, bool] | None:
    """``(bytes, the flag, whether the CUDA context counts)`` of the run's memory cap."""
    limit = getattr(cfg, "gpu_memory_limit", None)
    if limit is not None:  # torch's per-process fraction: the context is outside it
        return limit * GIB, f"--gpu-memory-limit {limit:g}", False
    card = getattr(cfg, "gpu_memory", None)
    if card is not None:
        return card * GIB, f"--gpu-memory {card:g}", True
    return None


def _need(plans: list[RankMemory], machine: Machine, context: bool) -> float:
    return max(r.needed(machine) if context else r.capped(machine) for r in plans)


def _variants(layout: Layout, global_batch: int) -> list[Layout]:
    zeros = sorted({layout.zero, 2, 3} if layout.dp > 1 else {layout.zero, 2})
    per_rank = global_batch // layout.dp
    mbs = [b for b in range(1, layout.micro_batch_size + 1) if per_rank % b == 0]
    out = []
    for zero, offload, ckpt, mb in itertools.product(
        zeros, sorted({layout.offload, 1.0}), [layout.checkpointing, True, "vision"], mbs
    ):
        if offload and zero < 2:
            continue
        out.append(
            dataclasses.replace(
                layout, zero=zero, offload=offload, checkpointing=ckpt, micro_batch_size=mb
            )
        )
    return out


def _changes(old: Layout, new: Layout) -> list[str]:
    """The flags that turn ``old`` into ``new``."""
    words = []
    if new.zero != old.zero:
        words.append(f"--zero {new.zero}")
    if new.offload != old.offload:
        words.append("--offload optimizer")
        if new.offload < 1:
            words.append(f"--offload-fraction {new.offload:g}")
    if new.checkpointing != old.checkpointing:
        words.append("--activation-checkpointing")
        if isinstance(new.checkpointing, str):
            words.append(f"--checkpoint-scope {new.checkpointing}")
    if new.micro_batch_size != old.micro_batch_size:
        words.append(f"--micro-batch-size {new.micro_batch_size}")
    return words


def fit_advice(
    model: Workload, cfg: TrainConfig, dims: ParallelDims, plans: list[RankMemory], machine: Machine
) -> str | None:
    """Whether the layout fits the run's cap, and the nearest changes that would make it."""
    cap = cap_of(cfg)
    if cap is None:
        return None
    limit, flag, context = cap
    need = _need(plans, machine, context)
    if need <= limit:
        return f"fits {flag} GiB: the busiest rank needs {need / GIB:.2f} GiB"
    layout = Layout.of(cfg, dims.dp)
    searcher = Searcher(model, machine)
    found = []
    for v in _variants(layout, cfg.global_batch_size):
        if v == layout or searcher.problem(v):
            continue
        vneed = _need(plan_memory(model, v, cfg.overlap_grad_reduce), machine, context)
        if vneed <= limit:
            changes = _changes(layout, v)
            found.append((len(changes), -v.micro_batch_size, vneed, " ".join(changes)))
    head = (
        f"does not fit {flag} GiB: the busiest rank needs {need / GIB:.2f} GiB "
        f"(the peak {max(r.gpu for r in plans) / GIB:.2f} GiB)"
    )
    if not found:
        return (
            f"{head}; no change of --zero, --offload, --activation-checkpointing or "
            "--micro-batch-size fits at this world size: `python -m parallax.plan` searches "
            "other layouts and GPU counts"
        )
    found.sort()
    shown = "; ".join(f"{words} ({n / GIB:.2f} GiB)" for _, _, n, words in found[:SHOWN])
    return f"{head}. These would fit: {shown}"
