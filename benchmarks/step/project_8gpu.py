"""A projection (not a measurement) of OpenVLA-7B at tp2 pp2 dp2 on 8 H200s.

Fed with times measured on 2 H200s (defaults: the rows of run 90f392cf8f7d and the profile in
``benchmarks/profiles``), it simulates the 1F1B schedule with :func:`parallax.pipeline.simulate`
and adds the optimizer and the data-parallel reduction:

- per-microbatch forward + backward of the whole model at tp2 = (tp2 step - its optimizer step)
  / microbatches per step, split over the 2 stages by the model's stage costs (the split the
  trainer uses), backward = 2 x forward;
- one activation transfer between stages (``--comm-ms``);
- the optimizer on a quarter of the parameters (AdamW over 7.5 B fp32 masters measured at about
  60 ms per step on one GPU, scaled) and the ZeRO-1 reduce-scatter / all-gather not hidden by
  the backward (the measured dp2 step minus half the 1gpu step, for the whole model, scaled to
  the quarter each rank holds).

    python -m benchmarks.step.project_8gpu                 # defaults: measured values on 2 H200s
    python -m benchmarks.step.project_8gpu --global-batch 128 --no-write
"""

from __future__ import annotations

import argparse

from benchmarks.tools.common import PEAK_BF16_TFLOPS, append_results, print_table
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.flops import openvla_flops_per_sample
from parallax.families.openvla.model import OpenVLA
from parallax.pipeline import one_f_one_b, simulate, split

SEQ = 297  # BOS + 256 patches + 40 text tokens


def project(args: argparse.Namespace) -> list[list[object]]:
    config = OpenVLAConfig.preset("openvla-7b")
    costs = [b.cost for b in OpenVLA.stage_blocks(config, text_tokens=40)]
    ranges = split(costs, 2, 1, pin_first=1)
    share = [sum(costs[i] for i in r) / sum(costs) for r in ranges]
    per_mb = (args.tp2_step - args.opt_7b / 2) / (32 / args.micro_batch)  # whole model, tp2
    fwd = [per_mb * s / 3 for s in share]
    bwd = [2 * f for f in fwd]
    flops = openvla_flops_per_sample(config, 40, logit_positions=8)
    rows = []
    for gb in args.global_batch:
        m = gb // (2 * args.micro_batch)  # microbatches per pipeline (dp2)
        sim = simulate(one_f_one_b(2, m), fwd, bwd, comm_time=args.comm_ms / 1e3)
        opt = args.opt_7b / 4
        dp_comm = (args.dp2_step - args.one_gpu_step / 2) / 4
        step = sim.makespan + opt + dp_comm
        tokens = gb * SEQ / step / 8
        mfu = gb * flops / step / (8 * PEAK_BF16_TFLOPS * 1e12)
        rows.append(
            [
                "tp2 pp2 dp2 (projection)",
                8,
                gb,
                args.micro_batch,
                m,
                sim.makespan,
                opt + dp_comm,
                step,
                tokens,
                mfu,
                sim.bubble_fraction,
            ]
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, nargs="+", default=[64, 128])
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--tp2-step", type=float, default=0.994, help="s, tp2 gbs 32 mb 8 (measured)")
    p.add_argument("--dp2-step", type=float, default=0.677, help="s, dp2 gbs 32 mb 8 (measured)")
    p.add_argument("--one-gpu-step", type=float, default=1.21, help="s, 1gpu gbs 32 mb 8")
    p.add_argument("--opt-7b", type=float, default=0.060, help="s, AdamW over 7.5 B on 1 GPU")
    p.add_argument("--comm-ms", type=float, default=0.2, help="one activation transfer")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    columns = [
        "layout",
        "GPUs",
        "global batch",
        "micro",
        "m",
        "pipeline s",
        "optim+dp s",
        "step s",
        "tokens/s/GPU",
        "MFU",
        "bubble (sim)",
    ]
    rows = project(args)
    title = "Projection (simulated, not measured): openvla-7b at tp2 pp2 dp2 on 8 H200s"
    print_table(title, columns, rows)
    if not args.no_write:
        notes = (
            "a projection from 2-GPU measurements (tp2 step, dp2 and 1gpu steps at micro-batch "
            "8, run 90f392cf8f7d / 902caad7e099, commit ee8cc5e / a14705f) through the 1F1B "
            "simulator; parallax opt variant without torch.compile; not a run on 8 GPUs"
        )
        append_results(title, columns, rows, notes=notes)


if __name__ == "__main__":
    main()
