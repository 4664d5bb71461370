"""What the offloaded optimizer (:mod:`parallax.optim.zero.offload.host_steps`) runs on the host:
which of torch's CPU kernels steps it, on how many threads, and a norm that is both fast and
accurate on billions of elements (which buckets go there:
:mod:`~parallax.optim.zero.offload.share`).

Measured on one H200 host (``benchmarks/zero/host_bound.py``, 16 cores): torch's float64 norm
runs at 1 GB/s on the CPU (13 s for a 7.5B model's gradient), a flat fp32 one is fast but off
by 1e-3 on large tensors, hence :func:`squares`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

ROW = 1024  # elements per partial sum of a norm


TOPOLOGY = Path("/sys/devices/system/cpu")  # Linux: each CPU's package and core


def _allowed() -> list[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core among ``cpus`` (the first of its SMT siblings), from
    Linux's topology files; ``cpus`` as given where those cannot be read. (torch's own default
    thread count is the physical cores: a memory-bound loop gains nothing from a sibling.)"""
    seen, out = set(), []
    for cpu in cpus:
        where = TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            core = ((where / "physical_package_id").read_text(), (where / "core_id").read_text())
        except OSError:
            return list(cpus)
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out


def host_cpus() -> tuple[list[int], bool]:
    """The CPUs for this process's host step, and whether to keep its threads on them: one per
    physical core, this local rank's share (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``), less one
    for the thread that drives the GPU where there are four or more (an OpenMP team waits for
    its slowest thread: one that shares a core holds up all of them). Kept on them only where
    that changes who shares a core (SMT siblings, or several ranks on the host); one rank on
    cores without siblings (the H200 host the offload was measured on) is left as it ran."""
    allowed = _allowed()
    cores = physical_cores(allowed)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    rank = int(os.environ.get("LOCAL_RANK", "0")) % local
    share = max(1, len(cores) // local)
    mine = cores[rank * share : (rank + 1) * share] or cores[:share]
    mine = mine[:-1] if len(mine) >= 4 else mine
    return mine, local > 1 or len(cores) < len(allowed)


def host_threads() -> int:
    """CPU threads for this process's host step (:func:`host_cpus`)."""
    return len(host_cpus()[0])


def keep_on(cpus: list[int]) -> bool:
    """Keep the calling thread, and the OpenMP team it starts later, on ``cpus``; whether the
    system let it (Linux only)."""
    try:
        os.sched_setaffinity(0, cpus)  # (0: the calling thread; its new threads inherit it)
    except (AttributeError, OSError, ValueError):
        return False
    return True


def squares(x: torch.Tensor) -> float:
    """The sum of squares of fp32 ``x`` to about 1e-7 relative, at fp32 speed: fp32 norms of
    rows of ``ROW`` elements (each rounded once), their squares summed in float64. torch's
    float64 norm runs at a twentieth of that speed on the CPU; a flat fp32 one drifts by 1e-3
    over tens of millions of elements."""
    m = x.numel() // ROW * ROW
    rows = torch.linalg.vector_norm(x[:m].view(-1, ROW), dim=1)  # (m / ROW,) fp32
    out = rows.double().square().sum() + torch.linalg.vector_norm(x[m:], dtype=torch.float64) ** 2
    return float(out)


@functools.cache
def cpu_fused_available(optimizer_class: type) -> bool:
    """Whether ``optimizer_class(fused=True)`` steps CPU tensors in this torch, also with a
    ``grad_scale`` (tried once)."""
    p = torch.zeros(2, requires_grad=True)
    try:
        opt = optimizer_class([p], lr=0.0, fused=True)
        p.grad = torch.zeros(2)
        opt.step()
        opt.grad_scale = torch.ones(())
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def host_options(optimizer_class: type, options: dict[str, Any]) -> dict[str, Any]:
    """The wrapped optimizer's options for host tensors: fused on the CPU where available,
    else foreach (torch's optimizers that take either; others as given)."""
    options = dict(options)
    if not optimizer_class.__module__.startswith("torch.optim"):
        return options
    options.pop("fused", None)
    options.pop("foreach", None)
    if cpu_fused_available(optimizer_class):
        options["fused"] = True
    else:
        options["foreach"] = True
    return options
