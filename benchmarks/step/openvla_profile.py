"""Where does a parallax training step spend its GPU time? One layout, torch.profiler.

Runs the openvla_step workload (synthetic batches, bf16, fp32 masters) under parallax's Trainer,
profiles ``--steps`` steps after warm-up, and writes rank 0's kernel table (top ops by GPU
time) plus the share of the step the GPU was busy to ``--out``:

    torchrun --nproc-per-node 2 -m benchmarks.step.openvla_profile --layout dp2 --out prof.txt
    torchrun --nproc-per-node 2 -m benchmarks.step.openvla_profile --smoke --layout pp2 --out p.txt
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.step.native import Workload, split_batch, synthetic_batch
from benchmarks.step.native.base import dp_share
from benchmarks.step.openvla_runs import Layout, parallax_config
from benchmarks.tools.common import sync
from parallax import init_parallel
from parallax.families.openvla.config import OpenVLAConfig
from parallax.recipe import resolve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="dp2")
    p.add_argument("--variant", default="opt")
    p.add_argument("--model", default=None)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from parallax.train.trainer import Trainer

    layout = Layout.parse(args.layout)
    ctx = init_parallel(tp=layout.tp, pp=layout.pp, dp=layout.dp)
    model = args.model or ("tiny" if args.smoke else "openvla-7b")
    config = OpenVLAConfig.preset(model)
    wl = Workload(
        config, micro_batch=args.micro_batch, autocast=None if args.smoke else torch.bfloat16
    )
    cfg = parallax_config(layout, wl, model, args.global_batch, args.variant)
    trainer = Trainer(resolve(cfg), ctx)
    batch = synthetic_batch(config, args.global_batch, 40, 8, device=ctx.device)
    mine = dp_share(split_batch(batch, args.micro_batch), ctx.dp_rank, ctx.dp_size)
    mine = [{**mb, "labels": mb["labels"].cpu()} for mb in mine]
    for _ in range(args.warmup):
        trainer.train_step(mine)
    sync(ctx.device)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else []
    )
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            trainer.train_step(mine)
        sync(ctx.device)
    wall = (time.perf_counter() - start) / args.steps
    if ctx.rank != 0:
        return
    key = "self_cuda_time_total" if ctx.device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    busy = (
        sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
        / 1e6
        / args.steps
    )
    head = (
        f"layout {layout.name}, variant {args.variant}, {model}, global batch "
        f"{args.global_batch}, micro-batch {args.micro_batch}: step {wall:.3f} s wall, "
        f"GPU kernel time {busy:.3f} s per step (rank 0, all streams summed)\n"
    )
    table = events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60)
    if ctx.device.type == "cuda":  # where the host's time goes too (launch-bound phases)
        table += "\nTop ops by host (self CPU) time:\n" + events.table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
        )
    kernels, phases = [], []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA:
            continue
        if e.is_user_annotation() or e.name().startswith(("Optimizer.", "parallax.")):
            if e.name().startswith("parallax."):  # the trainer's phases, on the GPU timeline
                phases.append((e.name(), e.start_ns(), e.end_ns()))
            continue
        kernels.append((e.device_resource_id(), e.start_ns(), e.end_ns(), e.name()))
    report = head + table + "\n" + timeline_report(kernels, args.steps, phases)
    with open(args.out, "w") as f:
        f.write(report)
    print(report)


KINDS = (  # first match wins
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|cudnn|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas"),
    ("adam", r"adam"),
    ("norm", r"norm"),
    ("copy", r"copy|memcpy|memset|fill"),
    ("compiled", r"triton"),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_report(
    kernels: list[tuple[int, int, int, str]],
    steps: int,
    phases: list[tuple[str, int, int]] = (),
    gaps: int = 12,
) -> str:
    """Per stream: kernel time by kind, busy time; for the busiest stream (the compute one),
    its idle time inside each named phase (``(name, start_ns, end_ns)`` spans on the GPU
    timeline) and its longest gaps with the kernels on either side; and how much communication
    ran under compute. ``kernels`` are ``(stream, start_ns, end_ns, name)``; times are per
    step."""
    if not kernels:
        return "no GPU kernels recorded\n"
    per = 1e6 * steps  # ns -> ms per step
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    streams: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for stream, a, b, name in kernels:
        streams[stream].append((a, b, name))
    lines = [f"timeline: {span / per:.1f} ms per step from first to last kernel"]
    busy = {s: _union([(a, b) for a, b, _ in ks]) for s, ks in streams.items()}
    for stream, ks in sorted(streams.items(), key=lambda kv: -_length(busy[kv[0]])):
        by_kind: dict[str, int] = defaultdict(int)
        for a, b, name in ks:
            by_kind[kind(name)] += b - a
        kinds = ", ".join(
            f"{k} {t / per:.1f}" for k, t in sorted(by_kind.items(), key=lambda x: -x[1])
        )
        lines.append(f"stream {stream}: busy {_length(busy[stream]) / per:.1f} ms ({kinds})")
    compute = max(streams, key=lambda s: sum(b - a for a, b, n in streams[s] if kind(n) != "nccl"))
    comm_busy = _union([(a, b) for s, ks in streams.items() if s != compute for a, b, _ in ks])
    lines.append(
        f"compute stream {compute}: idle {(span - _length(busy[compute])) / per:.1f} ms per step; "
        f"other streams busy {_length(comm_busy) / per:.1f} ms, "
        f"{_intersect(busy[compute], comm_busy) / per:.1f} of it under compute"
    )
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for name, a, b in phases:
        spans[name].append((a, b))
    for name, windows in sorted(spans.items(), key=lambda kv: min(a for a, _ in kv[1])):
        windows = _union(windows)
        length, inside = _length(windows), _intersect(windows, busy[compute])
        lines.append(
            f"phase {name}: {length / per:.1f} ms per step on the GPU timeline, compute stream "
            f"busy {inside / per:.1f}, idle {(length - inside) / per:.1f}"
        )
    ks = sorted(streams[compute])
    holes = sorted(
        ((ks[i + 1][0] - ks[i][1], ks[i][2], ks[i + 1][2]) for i in range(len(ks) - 1)),
        reverse=True,
    )
    total_gap = sum(h[0] for h in holes if h[0] > 0)
    lines.append(
        f"compute stream gaps: {total_gap / per:.1f} ms per step in total; the longest "
        f"(over all {steps} steps):"
    )
    for gap, before, after in holes[:gaps]:
        lines.append(f"  {gap / 1e6:8.2f} ms  after {before[:70]}  before {after[:70]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
