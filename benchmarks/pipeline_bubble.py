"""How big is the pipeline bubble, measured, simulated and in theory, and how does torch compare?

Each pipeline rank holds a stack of MLP blocks (hidden ``h``, ffn ``4h``); every schedule (GPipe,
1F1B, interleaved 1F1B with 2 chunks per rank) runs for a range of microbatch counts. For each:
the median step time, the bubble measured from the timeline (idle share of the ranks' time),
the bubble implied by the step time (``1 - m x per-microbatch compute / step time``, computable
for any framework), the simulated bubble (the same schedule fed the measured per-stage forward
and backward times) and the textbook one ``(p - 1) / (v m + p - 1)``. The yardstick is
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same blocks and batches.

    torchrun --nproc-per-node 2 -m benchmarks.pipeline_bubble            # GPUs: bf16
    torchrun --nproc-per-node 2 -m benchmarks.pipeline_bubble --smoke    # CPU: fp32, tiny

Chrome traces (one per schedule and microbatch count) go to ``--out`` (default
``runs/pipeline_bubble``); open them in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import append_results, median, print_table, sync, time_it
from parallax import init_parallel
from parallax.pipeline import (
    PipelineStage,
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

HERE = Path(__file__).resolve().parent


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


def schedules(p: int, microbatches: list[int]):
    for m in microbatches:
        yield "GPipe", m, gpipe(p, m)
        if m >= p:
            yield "1F1B", m, one_f_one_b(p, m)
        if m % p == 0:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 sizes for a CPU run")
    parser.add_argument("--microbatches", default=None, help="comma list, e.g. 4,8,16,32")
    parser.add_argument("--layers-per-rank", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", default=str(HERE.parent / "runs" / "pipeline_bubble"))
    parser.add_argument("--no-torch", action="store_true", help="skip the torch yardstick")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    ctx = init_parallel(pp=int(os.environ.get("WORLD_SIZE", "1")))  # every rank is a stage
    p, device = ctx.pp_size, ctx.device
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    h, seq, mb = (2048, 1024, 4) if not args.smoke else (64, 32, 2)
    layers = args.layers_per_rank or (8 if not args.smoke else 4)
    iters = args.iters or (10 if not args.smoke else 3)
    default_ms = "4,8,16,32" if not args.smoke else "2,4,8"
    microbatches = [int(v) for v in (args.microbatches or default_ms).split(",")]
    num_blocks = layers * p

    def make(i: int) -> nn.Module:
        torch.manual_seed(i)
        return MLPBlock(h, dtype, device)

    gen = torch.Generator(device=device).manual_seed(0)
    rows, records = [], []
    for name, m, schedule in schedules(p, microbatches):
        x = torch.randn(m * mb, seq, h, device=device, dtype=dtype, generator=gen)
        y = torch.randn(m * mb, seq, h, device=device, dtype=dtype, generator=gen)
        inputs, targets = list(x.chunk(m)), list(y.chunk(m))
        stages: list[PipelineStage] = build_stages(make, num_blocks, ctx, schedule.chunks_per_rank)
        busy = m * per_microbatch_compute(stages, inputs[0], device, iters)
        for stage in stages:
            stage.module.zero_grad(set_to_none=True)

        def step(timeline=None, stages=stages, schedule=schedule, inputs=inputs, targets=targets):
            run_schedule(schedule, stages, ctx, inputs, targets, loss_fn, timeline=timeline)

        step_time = median(time_it(step, device, warmup=2, iters=iters))
        timeline = Timeline()
        step(timeline)
        sync(device)
        events = gather_events(timeline, ctx)
        busy_all = [busy]
        if p > 1:
            busy_all = [None] * p
            dist.all_gather_object(busy_all, busy)
        step_bubble = 1 - sum(busy_all) / len(busy_all) / step_time
        if ctx.rank == 0:
            fwd, bwd = measured_costs(events, schedule.num_stages)
            sim = simulate(schedule, fwd, bwd).bubble_fraction
            out = Path(args.out) / f"{name.split('(')[0].lower()}_p{p}_m{m}.trace.json"
            write_chrome_trace(out, events)
            measured = measured_bubble(events)
            theory = theoretical_bubble(schedule)
            rows.append([name, "parallax", m, step_time * 1e3, measured, step_bubble, sim, theory])
            records.append(
                {
                    "benchmark": "pipeline_bubble",
                    "framework": "parallax",
                    "schedule": name,
                    "layout": f"pp{p}",
                    "microbatches": m,
                    "step_time_s": step_time,
                    "bubble_measured": measured,
                    "bubble_step_time": step_bubble,
                    "bubble_simulated": sim,
                    "bubble_theory": theory,
                }
            )
        del stages
        if name in ("GPipe", "1F1B") and not args.no_torch:
            blocks = nn.Sequential(
                *(make(i) for i in range(ctx.pp_rank * layers, (ctx.pp_rank + 1) * layers))
            )
            t = torch_pipelining(name, blocks, ctx, m, (x, y), device, iters)
            tb = 1 - sum(busy_all) / len(busy_all) / t
            if ctx.rank == 0:
                rows.append(
                    [
                        name,
                        "torch.pipelining",
                        m,
                        t * 1e3,
                        math.nan,
                        tb,
                        math.nan,
                        theoretical_bubble(schedule),
                    ]
                )
                records.append(
                    {
                        "benchmark": "pipeline_bubble",
                        "framework": "torch.distributed.pipelining",
                        "schedule": name,
                        "layout": f"pp{p}",
                        "microbatches": m,
                        "step_time_s": t,
                        "bubble_step_time": tb,
                    }
                )
    columns = [
        "schedule",
        "framework",
        "microbatches",
        "step ms",
        "bubble measured",
        "bubble from step time",
        "bubble simulated",
        "bubble theory",
    ]
    title = (
        f"pipeline_bubble: pp{p}, {layers} MLP blocks (h={h}) per rank, "
        f"microbatch {mb}x{seq} tokens, {dtype}"
    )
    if ctx.rank == 0:
        print_table(title, columns, rows)
        print(f"traces: {args.out}")
        if not args.no_write:
            notes = (
                "measured = idle share of the ranks' timeline; from step time = 1 - m x "
                "per-microbatch compute / step time (any framework); simulated = the schedule fed "
                "the measured per-stage costs; theory = (p-1)/(v m + p-1)"
                + ("; CPU smoke run, sizes scaled down" if args.smoke else "")
            )
            append_results(title, columns, rows, notes=notes, records=records)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
