"""One configuration (layout x framework) of the OpenVLA training-step benchmark: build the
trainer, warm it up, time its steps, and read memory, loss and (pipelines) the bubble.

Every function here runs on every rank of the configuration and returns this rank's
:class:`Measured`; the caller merges them across ranks.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from benchmarks.step.native import (
    MissingAPI,
    Workload,
    build_ddp_zero,
    build_dtensor_tp,
    build_fsdp2,
    build_pipelining,
    build_single,
)
from benchmarks.step.openvla_layout import FRAMEWORKS, NATIVE, NATIVE_VARIANTS, Layout
from benchmarks.step.openvla_parallax import VARIANTS, parallax_config, run_parallax
from benchmarks.step.timing import Measured, free_memory, gather, time_steps
from benchmarks.tools.common import peak_memory_gib
from parallax.context import ParallelContext, init_parallel

__all__ = [  # the layouts, the timing and parallax's rows live in their own files; importable
    # from here too
    "FRAMEWORKS",
    "NATIVE",
    "NATIVE_VARIANTS",
    "VARIANTS",
    "Layout",
    "Measured",
    "free_memory",
    "gather",
    "merge",
    "native_workload",
    "parallax_config",
    "run_config",
    "run_native",
    "time_steps",
]

Batch = dict[str, torch.Tensor]


def run_native(
    framework: str,
    wl: Workload,
    device: torch.device,
    microbatches: Sequence[Batch],
    warmup: int,
    steps: int,
) -> Measured:
    """Build ``framework`` over every rank of the default group and time its steps."""
    builders = {
        "torch-single": build_single,
        "torch-ddp-zero": build_ddp_zero,
        "torch-fsdp2": build_fsdp2,
        "torch-dtensor-tp": build_dtensor_tp,
    }
    if framework == "torch-pipelining":
        runner = build_pipelining(wl, device, len(microbatches), microbatches[0])
    else:
        runner = builders[framework](wl, device)
    times, first, loss = time_steps(lambda: runner.step(microbatches), device, warmup, steps)
    return Measured(times, peak_memory_gib(device), loss, first)


def native_workload(wl: Workload, variant: str, compile_backend: str) -> Workload:
    """The workload of a native row of ``variant`` (:data:`NATIVE_VARIANTS`)."""
    if variant not in NATIVE_VARIANTS:
        raise ValueError(f"native variant {variant!r}: choose from {', '.join(NATIVE_VARIANTS)}")
    return replace(wl, compile_backend=compile_backend if variant == "compile" else None)


def run_config(layout, framework, wl, args, device, microbatches, contexts, variant=None) -> dict:
    """This rank's outcome of one configuration (``variant``: parallax's, see
    :data:`VARIANTS`, or the native's, :data:`NATIVE_VARIANTS`): measurements or the error,
    never raising. A torch without a native's best-form API gives ``skipped: <why>``."""
    try:
        if framework == "parallax":
            if layout.name not in contexts:
                contexts[layout.name] = (
                    ParallelContext.local(device)
                    if layout.gpus == 1
                    else init_parallel(
                        tp=layout.tp,
                        pp=layout.pp,
                        dp=layout.dp,
                        backend="gloo" if args.smoke else None,
                        timeout=args.timeout,
                    )
                )
            m = run_parallax(
                layout,
                wl,
                contexts[layout.name],
                args.model,
                microbatches,
                args.warmup,
                args.steps,
                variant or "opt",
                args.compile_backend,
            )
        else:
            native = native_workload(wl, variant or "eager", args.compile_backend)
            m = run_native(framework, native, device, microbatches, args.warmup, args.steps)
        return {
            "times": m.step_times,
            "peak": m.peak_gib,
            "loss": m.loss,
            "first_loss": m.first_loss,
            **m.extra,
        }
    except MissingAPI as err:  # the same torch on every rank: every rank skips
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{layout.name} {framework} {variant or ''}: skipped: {err}", flush=True)
        return {"error": f"skipped: {err}"}
    except Exception as err:  # an OOM or a missing piece: record it, keep going
        print(
            f"[rank {dist.get_rank() if dist.is_initialized() else 0}] {layout.name} "
            f"{framework} {variant or ''} failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


def merge(results: list[dict]) -> dict:
    """One configuration across ranks: the slowest rank's median step, the largest peak."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    out = dict(results[0])
    out["step"] = max(statistics.median(r["times"]) for r in results)
    out["peak"] = max(r["peak"] for r in results)
    return out
