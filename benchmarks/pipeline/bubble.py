"""How big is the pipeline bubble, measured, simulated and in theory, and how does torch compare?

Each pipeline rank holds a stack of MLP blocks (hidden ``h``, ffn ``4h``); every schedule (GPipe,
1F1B, interleaved 1F1B with 2 chunks per rank) runs for a range of microbatch counts. For each:
the median step time, the bubble measured from the timeline (idle share of the ranks' time),
the bubble implied by the step time (``1 - m x per-microbatch compute / step time``, computable
for any framework), the simulated bubble (the same schedule fed the measured per-stage forward
and backward times) and the textbook one ``(p - 1) / (v m + p - 1)``. The yardstick is
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same blocks and batches.

    torchrun --nproc-per-node 2 -m benchmarks.pipeline.bubble          # GPUs: bf16
    torchrun --nproc-per-node 2 -m benchmarks.pipeline.bubble --smoke  # CPU: fp32, tiny

Chrome traces (one per schedule and microbatch count) go to ``--out`` (default
``runs/pipeline_bubble``); open them in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.tools.common import (
    append_results,
    median,
    peak_memory_gib,
    print_table,
    sync,
    time_it,
)
from parallax import comm, init_parallel
from parallax.pipeline import (
    TensorMeta,
    Timeline,
    build_stages,
    gather_events,
    gpipe,
    interleaved_1f1b,
    measured_bubble,
    one_f_one_b,
    run_schedule,
    simulate,
    theoretical_bubble,
    write_chrome_trace,
)


class MLPBlock(nn.Module):
    def __init__(self, h: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h, dtype=dtype, device=device)
        self.up = nn.Linear(h, 4 * h, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(4 * h, h, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))  # (b, s, h)


def loss_fn(output, target):
    return F.mse_loss(output.float(), target.float())


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def schedules(p: int, microbatches: list[int], kinds: tuple[str, ...] = SCHEDULES):
    for m in microbatches:
        if "gpipe" in kinds:
            yield "GPipe", m, gpipe(p, m)
        if "1f1b" in kinds and m >= p:
            yield "1F1B", m, one_f_one_b(p, m)
        if "interleaved" in kinds and m % p == 0:
            yield "Interleaved1F1B(v=2)", m, interleaved_1f1b(p, m, 2)


def per_microbatch_compute(stages, x, device, iters: int) -> float:
    """Seconds of forward + backward of this rank's chunks on one microbatch, no communication."""

    def step():
        for stage in stages:
            stage.module(x).float().pow(2).mean().backward()

    return median(time_it(step, device, warmup=2, iters=iters))


def measured_costs(events: list[dict], num_stages: int) -> tuple[list[float], list[float]]:
    """Mean forward and backward span per virtual stage, from a gathered timeline."""
    spans = defaultdict(list)
    for e in events:
        if e["cat"] == "compute":
            spans[(e["name"][len(str(e["args"]["stage"]))], e["args"]["stage"])].append(e["dur"])
    mean = {k: sum(v) / len(v) for k, v in spans.items()}
    return [mean[("F", s)] for s in range(num_stages)], [mean[("B", s)] for s in range(num_stages)]


def torch_pipelining(kind: str, blocks: nn.Module, ctx, m: int, batch, device, iters: int):
    """Median step time of torch.distributed.pipelining on the same blocks (one per rank)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    x, y = batch
    example = x[: x.shape[0] // m]
    stage = TorchStage(blocks, ctx.pp_rank, ctx.pp_size, device, input_args=(example,))
    cls = ScheduleGPipe if kind == "GPipe" else Schedule1F1B
    schedule = cls(stage, m, loss_fn=loss_fn)

    def step():
        blocks.zero_grad(set_to_none=True)
        if ctx.is_first_stage:
            schedule.step(x)
        elif ctx.is_last_stage:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    return median(time_it(step, device, warmup=2, iters=iters))


COLUMNS = [
    "schedule",
    "framework",
    "microbatches",
    "step ms",
    "bubble measured",
    "bubble from step time",
    "bubble simulated",
    "bubble theory",
    "peak GiB",
]


def run_parallax(
    name, m, schedule, ctx, make, num_blocks, data, iters, out_dir, known_shapes=False
):
    """Step time, timeline and bubbles of one schedule; returns (row, record, busy) on rank 0."""
    device, (inputs, targets) = ctx.device, data
    stages = build_stages(make, num_blocks, ctx, schedule.chunks_per_rank)
    busy = m * per_microbatch_compute(stages, inputs[0], device, iters)
    busy = sum(comm.all_gather_object(busy, ctx.world_group)) / ctx.world_size
    for stage in stages:
        stage.module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    agreed = []  # the ranks agree on the program once, as parallax.train does
    meta = TensorMeta(tuple(inputs[0].shape), inputs[0].dtype, True)

    def metas(stage: int, microbatch: int) -> list[TensorMeta]:
        return [meta]  # every stage passes one (mb, seq, h) tensor on

    def step(timeline=None):
        run_schedule(
            schedule,
            stages,
            ctx,
            inputs,
            targets,
            loss_fn,
            timeline=timeline,
            agree=not agreed,
            recv_metas=metas if known_shapes else None,
        )
        agreed.append(True)

    step_time = median(time_it(step, device, warmup=2, iters=iters))
    timeline = Timeline()
    step(timeline)
    sync(device)
    peak = peak_memory_gib(device)
    events = gather_events(timeline, ctx)
    if ctx.rank != 0:
        return None, None, busy
    fwd, bwd = measured_costs(events, schedule.num_stages)
    sim = simulate(schedule, fwd, bwd).bubble_fraction
    write_chrome_trace(
        Path(out_dir) / f"{name.split('(')[0].lower()}_p{ctx.pp_size}_m{m}.trace.json", events
    )
    measured, theory = measured_bubble(events), theoretical_bubble(schedule)
    step_bubble = 1 - busy / step_time
    fw = "parallax (known shapes)" if known_shapes else "parallax"
    row = [name, fw, m, step_time * 1e3, measured, step_bubble, sim, theory, peak]
    record = {
        "benchmark": "pipeline_bubble",
        "framework": "parallax",
        "known_shapes": known_shapes,
        "schedule": name,
        "layout": f"pp{ctx.pp_size}",
        "microbatches": m,
        "step_time_s": step_time,
        "bubble_measured": measured,
        "bubble_step_time": step_bubble,
        "bubble_simulated": sim,
        "bubble_theory": theory,
        "peak_gib": peak,
    }
    return row, record, busy


def run_torch(name, m, schedule, ctx, make, layers, data, iters, busy):
    """The same blocks and batch under torch.distributed.pipelining (rank 0 gets the row)."""
    device = ctx.device
    first = ctx.pp_rank * layers
    blocks = nn.Sequential(*(make(i) for i in range(first, first + layers)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = torch_pipelining(name, blocks, ctx, m, data, device, iters)
    peak = peak_memory_gib(device)
    if ctx.rank != 0:
        return None, None
    theory, bubble = theoretical_bubble(schedule), 1 - busy / t
    row = [name, "torch.pipelining", m, t * 1e3, math.nan, bubble, math.nan, theory, peak]
    record = {
        "benchmark": "pipeline_bubble",
        "framework": "torch.distributed.pipelining",
        "schedule": name,
        "layout": f"pp{ctx.pp_size}",
        "microbatches": m,
        "step_time_s": t,
        "bubble_step_time": bubble,
        "peak_gib": peak,
    }
    return row, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 sizes for a CPU run")
    parser.add_argument("--microbatches", default=None, help="comma list, e.g. 4,8,16,32")
    parser.add_argument("--layers-per-rank", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", default="runs/pipeline_bubble", help="folder for the traces")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch yardstick")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help=f"comma list of {', '.join(SCHEDULES)}"
    )
    parser.add_argument(
        "--known-shapes",
        action="store_true",
        help="give run_schedule the activation shapes (recv_metas), as parallax.train does: no "
        "host read of each message's metadata",
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        default=120.0,
        help="seconds one configuration may take before every rank prints its stack and exits",
    )
    args = parser.parse_args()
    kinds = tuple(k.strip().lower() for k in args.schedules.split(","))
    if bad := [k for k in kinds if k not in SCHEDULES]:
        parser.error(f"unknown schedules {bad}; choose from {', '.join(SCHEDULES)}")

    ctx = init_parallel(pp=int(os.environ.get("WORLD_SIZE", "1")))  # every rank is a stage
    p, device = ctx.pp_size, ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, seq, mb = (2048, 1024, 4) if not args.smoke else (64, 32, 2)
    layers = args.layers_per_rank or (8 if not args.smoke else 4)
    iters = args.iters or (10 if not args.smoke else 3)
    microbatches = [
        int(v) for v in (args.microbatches or ("2,4,8" if args.smoke else "4,8,16,32")).split(",")
    ]

    def make(i: int) -> nn.Module:
        torch.manual_seed(i)  # the same weights for block i in both frameworks
        return MLPBlock(h, dtype, device)

    gen = torch.Generator(device=device).manual_seed(0)
    rows, records = [], []
    for name, m, schedule in schedules(p, microbatches, kinds):
        # a stuck configuration shows where each rank waits instead of hanging silently
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        start = time.perf_counter()
        x = torch.randn(m * mb, seq, h, device=device, dtype=dtype, generator=gen)
        y = torch.randn(m * mb, seq, h, device=device, dtype=dtype, generator=gen)
        data = (list(x.chunk(m)), list(y.chunk(m)))
        row, record, busy = run_parallax(
            name, m, schedule, ctx, make, layers * p, data, iters, args.out, args.known_shapes
        )
        rows.append(row)
        records.append(record)
        if name in ("GPipe", "1F1B") and not args.no_torch:
            try:
                row, record = run_torch(name, m, schedule, ctx, make, layers, (x, y), iters, busy)
            except Exception as err:  # an API this torch lacks fails alike on every rank
                if ctx.rank == 0:
                    print(f"torch.distributed.pipelining {name} skipped: {err!r}")
                continue
            rows.append(row)
            records.append(record)
        if ctx.rank == 0:
            print(f"{name} m={m}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    faulthandler.cancel_dump_traceback_later()
    title = (
        f"pipeline_bubble: pp{p}, {layers} MLP blocks (h={h}) per rank, "
        f"microbatch {mb}x{seq} tokens, {dtype}"
    )
    if ctx.rank == 0:
        print_table(title, COLUMNS, rows)
        print(f"traces: {args.out}")
        if not args.no_write:
            notes = (
                "measured = idle share of the ranks' timeline; from step time = 1 - m x "
                "per-microbatch compute / step time (any framework); simulated = the schedule fed "
                "the measured per-stage costs; theory = (p-1)/(v m + p-1)"
                + ("; CPU smoke run, sizes scaled down" if args.smoke else "")
            )
            append_results(title, COLUMNS, rows, notes=notes, records=records)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
