"""Where a benchmark row spends its GPU time: one LoRA or SigLIP row under torch.profiler.

Builds the row as its benchmark does (``lora``: :class:`benchmarks.step.lora.Row` from
``lora_step``'s own flags; ``siglip``: a system of :mod:`benchmarks.step.siglip_systems`),
warms it up, times three steps unprofiled, profiles two and writes: the step time, the peak
memory, GPU time per kernel kind (gemm, attention, compiled element-wise, norm, copy, adam), the
top kernels, and the compute stream's idle time
(:func:`benchmarks.step.openvla_profile.timeline_report`); a planner row also gets its lanes,
what each stream and host thread did when (:mod:`benchmarks.tools.lanes`)::

    python -m benchmarks.tools.profile_rows --out lora.txt lora --compile --cuda-graphs --batch 16
    python -m benchmarks.tools.profile_rows --out siglip.txt siglip parallax 512
    python -m benchmarks.tools.profile_rows --out s.txt siglip torch 4 --smoke   # CPU: no kernels
    python -m benchmarks.tools.profile_rows --out p.txt plan fit:lora-16 --compile  # a planner row

``plan`` runs a row of ``plan_accuracy`` (``openvla``) or of ``memory_fit`` (``fit:lora-16``,
under its cap) as those benchmarks do: is the step bound by the GPU or by the host between its
kernels?

Why: a row's GEMM time is a floor that no framework change below the GEMMs moves, so it bounds
the speed-up any framework can have over a peer that runs the same GEMMs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.step.openvla_profile import kind, timeline_report
from benchmarks.tools.common import sync
from benchmarks.tools.lanes import lanes

PROFILED = 2  # steps under the profiler


def kernel_summary(prof, steps: int, rows: int = 40) -> str:
    """GPU time per kind and the top ``rows`` kernels, per step."""
    kernels, totals = [], defaultdict(lambda: [0, 0])
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA or e.is_user_annotation():
            continue
        if e.name().startswith(("Optimizer.", "parallax.")):
            continue
        kernels.append((e.device_resource_id(), e.start_ns(), e.end_ns(), e.name()))
        totals[e.name()][0] += 1
        totals[e.name()][1] += e.end_ns() - e.start_ns()
    per = 1e6 * steps  # ns -> ms per step
    by_kind: dict[str, int] = defaultdict(int)
    for name, (_, ns) in totals.items():
        by_kind[kind(name)] += ns
    ranked = sorted(by_kind.items(), key=lambda x: -x[1])
    lines = ["by kind (ms/step): " + ", ".join(f"{k} {v / per:.1f}" for k, v in ranked)]
    lines.append("top kernels: ms/step, calls/step, kind, name")
    for name, (calls, ns) in sorted(totals.items(), key=lambda x: -x[1][1])[:rows]:
        lines.append(f"{ns / per:9.2f} {calls / steps:7.0f}  {kind(name):9s} {name[:140]}")
    lines.append(timeline_report(kernels, steps))
    return "\n".join(lines)


def profile_step(step: Callable[[], object], device: torch.device, warmup: int) -> tuple:
    """``(seconds per unprofiled step, profiler)`` after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        step()
    sync(device)
    wall = (time.perf_counter() - start) / 3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED):
            step()
        sync(device)
    return wall, prof


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def lora(argv: list[str]) -> str:
    from benchmarks.step import lora as lora_step
    from benchmarks.step.native import synthetic_batch
    from parallax import ParallelContext
    from parallax.families.openvla.config import OpenVLAConfig

    args = lora_step.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = OpenVLAConfig.preset(args.model)
    row = lora_step.Row(args, config, ParallelContext.local(device=device))
    b = int(args.batch)
    batch = synthetic_batch(config, b, 1 + args.text_tokens, args.labelled, seed=0, device=device)
    wall, prof = profile_step(row.step(batch, args.micro_batch or b), device, args.warmup)
    head = f"lora {' '.join(argv)}: step {wall:.4f} s unprofiled, peak {_peak(device):.2f} GiB"
    return head + "\n" + kernel_summary(prof, PROFILED)


def siglip(argv: list[str]) -> str:
    from benchmarks.step import siglip as contrastive_step
    from benchmarks.step.siglip_systems import SYSTEMS, make_batch
    from parallax.families.siglip.config import SiglipConfig
    from parallax.families.siglip.model import Siglip

    system, b, rest = argv[0], int(argv[1]), argv[2:]
    args = contrastive_step.parse_args(rest)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = SiglipConfig.preset("siglip-tiny" if args.smoke else args.model)
    with tempfile.TemporaryDirectory() as root:
        weights = Path(root) / "hf"
        Siglip(config, seed=0).save_pretrained(weights)  # the benchmark's shared start
        px, ids = make_batch(config, b, device)
        step = SYSTEMS[system](args, config, weights, device, b)
        wall, prof = profile_step(lambda: step(px, ids), device, warmup=3)
    head = (
        f"siglip {system} batch {b}: step {wall:.4f} s unprofiled ({b / wall:.1f} samples/s), "
        f"peak {_peak(device):.1f} GiB"
    )
    return head + "\n" + kernel_summary(prof, PROFILED)


def planned(argv: list[str]) -> str:
    """A row of ``plan_accuracy`` or ``memory_fit`` as they run it: the planner's layout (under
    the row's cap), the trainer, the trainer's synthetic data."""
    from benchmarks.plan.accuracy import ROWS, SMOKE, batch_source, described, plan_row
    from benchmarks.zero.memory_fit import ROWS as FIT_ROWS
    from parallax import ParallelContext
    from parallax.train.memory_limit import cap_gpu_memory
    from parallax.train.trainer import Trainer

    p = argparse.ArgumentParser(prog="profile_rows plan")
    p.add_argument("name", help="a row of plan_accuracy, or fit:ROW of memory_fit (fit:lora-16)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--pad-to-multiple-of", type=int, default=1)
    p.add_argument("--grad-clip", type=float, help="the run's --grad-clip (default: the trainer's)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    args.out, args.machine = "runs/profile_rows", None
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = {r.name: r for r in (SMOKE if args.smoke else ROWS)}
    rows |= {f"fit:{r.name}": r for r in FIT_ROWS}  # memory_fit's, whose names repeat
    row = rows[args.name]
    run, best, _ = plan_row(row, args, device, closest=True)
    if device.type == "cuda":
        cap_gpu_memory(row.limit, device)
    run = run.replace(**best.layout.options())
    ctx = ParallelContext.local(device=device)
    trainer, next_batch = Trainer(run, ctx), batch_source(run, ctx)
    wall, prof = profile_step(lambda: trainer.train_step(next_batch()).loss.item(), device, 2)
    head = (
        f"plan {args.name} ({described(best, run)}): step {wall:.4f} s unprofiled, predicted "
        f"{best.time.seconds:.4f} s, peak {_peak(device):.2f} GiB"
    )
    return head + "\n" + kernel_summary(prof, PROFILED) + "\n" + lanes(prof, bins=120)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("row", choices=("lora", "siglip", "plan"))
    args, rest = p.parse_known_args(argv)
    text = {"lora": lora, "siglip": siglip, "plan": planned}[args.row](rest)
    Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
