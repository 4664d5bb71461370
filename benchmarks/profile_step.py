"""Where does a parallax training step spend its GPU time? One layout, torch.profiler.

Runs the openvla_step workload (synthetic batches, bf16, fp32 masters) under parallax's Trainer,
profiles ``--steps`` steps after warm-up, and writes rank 0's kernel table (top ops by GPU
time) plus the share of the step the GPU was busy to ``--out``:

    torchrun --nproc-per-node 2 -m benchmarks.profile_step --layout dp2 --out prof.txt
    torchrun --nproc-per-node 2 -m benchmarks.profile_step --smoke --layout pp2 --out p.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import sync
from benchmarks.native import Workload, split_batch, synthetic_batch
from benchmarks.native.base import dp_share
from benchmarks.openvla_runs import Layout, parallax_config
from parallax import init_parallel
from parallax.models import OpenVLAConfig


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
    trainer = Trainer(cfg, ctx)
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
    with open(args.out, "w") as f:
        f.write(head + table)
    print(head + table)


if __name__ == "__main__":
    main()
