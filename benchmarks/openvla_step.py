"""OpenVLA-7B full fine-tuning steps: parallax against PyTorch's own parallelism, in one run.

Workload: synthetic batches of BOS + 256 image patches + ``--text-tokens`` (40) text tokens, the
loss on the last ``--labelled`` (8) positions (7 action tokens and EOS); bf16 compute, fp32
master weights and fp32 AdamW state everywhere. Every layout that fits the GPUs present runs
(``1gpu``; with 2 GPUs also ``tp2``, ``pp2``, ``dp2``), each under parallax's Trainer and the
PyTorch tools that cover it: ``torch-single`` (1gpu), ``torch-ddp-zero`` and ``torch-fsdp2``
(dp), ``torch-dtensor-tp`` (tp), ``torch-pipelining`` (pp, 1F1B), all on the same model code
and the same global batch (gradient accumulation over micro-batches where it needs it).

Per configuration: the median step time over ``--steps`` (>= 10) after ``--warmup``, tokens/s
per GPU (tokens = the 297-token sequence the language model sees), samples/s, model TFLOP/s per
GPU and MFU (``parallax.train.flops``: 6 x params x tokens per component plus attention, against
989 TFLOP/s), peak memory per GPU (max over ranks) and, for parallax pipelines, the bubble
measured on a Timeline next to the one simulated from the measured stage times. The table's
``x best native`` is tokens/s per GPU over the best PyTorch-native configuration with as many
GPUs. Each configuration runs in its own try/except (an OOM becomes an error row) and writes
its JSON line to ``benchmarks/results.jsonl`` as soon as it is measured; ``--time-budget``
skips what would not finish in time. A configuration that fails on one rank only leaves its
peers waiting in a collective until ``--timeout``.

parallax runs as ``--parallax-variants`` (``variant`` column and JSON key): ``opt`` is the
Trainer's defaults (lm_head on the labelled positions only, fused q/k/v and gate/up, no
per-step pipeline host syncs), ``base`` all of that off, ``opt+compile`` adds ``torch.compile``
of each block. Running order puts what answers the issue first: parallax ``opt`` on the
multi-GPU layouts, the natives there, the one-GPU rows, then the other variants. Each row's
MFU counts the FLOPs it runs (the lm_head over all positions, or the labelled ones).

    torchrun --nproc-per-node 2 -m benchmarks.openvla_step --time-budget 480       # 2 H200
    torchrun --nproc-per-node 2 -m benchmarks.openvla_step --smoke --model tiny --no-write

Memory plan at 7.5 B parameters (H200: ~140 GiB usable; activations ~3.3 GB per sample at
bf16 without checkpointing; ``expandable_segments`` is switched on against fragmentation):

- torch-single: fp32 params + grads + AdamW = 16 B/param = 120 GB, plus the bf16 weight copies
  autocast keeps for the backward (15 GB): micro-batch 2 is at the edge, it may OOM (fused
  AdamW, so no multi-tensor temporaries; ``--activation-checkpointing`` frees most of the rest).
- parallax 1gpu: bf16 params and grads + fp32 master and moments = 2 + 2 + 12 = 16 B/param,
  plus one fp32 staging buffer of the largest bucket (0.5 GB: each bucket's fp32 gradient is
  made right before the optimizer steps it, no whole-model fp32 gradient) = 120.5 GB = 112 GiB
  (7.5e9 trainable): fits, with about 27 GiB left for activations at micro-batch 2. (It was
  20 B/param = 150 GB = 140 GiB, which did not fit, while the fp32 gradient was kept whole.)
- torch-ddp-zero dp2: 4 + 4 (gradients as bucket views) + 8/2 = 12 B/param = 90 GB + 15 GB.
- parallax dp2 (overlap): 2 + 2 + 16/2 = 12.1 B/param (staging included) = 91 GB; without
  overlap the fp32 gradient goes over the bf16 gradient bytes: 10.1 B/param = 76 GB.
  torch-fsdp2 dp2: 16/2 = 8 B/param = 60 GB.
- tp2 and pp2 (both frameworks, dp=1): about half the parameters per GPU: 60 GB (natives and
  parallax) plus activations; micro-batch 4 fits.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.common import append_records, append_results, env_info, print_table
from benchmarks.native import Workload, split_batch, synthetic_batch
from benchmarks.openvla_runs import (
    FRAMEWORKS,
    VARIANTS,
    Layout,
    free_memory,
    gather,
    merge,
    run_config,
)
from benchmarks.openvla_table import COLUMNS, ratio_notes, summarise
from parallax import ParallelContext
from parallax.models import OpenVLAConfig
from parallax.models.openvla_flops import openvla_flops_per_sample
from parallax.train.config import TrainConfig
from parallax.train.flops import PEAK_TFLOPS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, fp32, small sizes")
    p.add_argument("--model", default=None, help="openvla-7b (default), small, tiny (smoke)")
    p.add_argument("--layouts", default=None, help="comma list, e.g. 1gpu,tp2,pp2,dp2")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma list")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (32)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 2 on 1 GPU, else 4")
    p.add_argument(
        "--single-batch",
        type=int,
        default=None,
        help="global batch of the one-GPU rows (default: --global-batch); the dp rows' samples "
        "per GPU measure weak scaling",
    )
    p.add_argument("--text-tokens", type=int, default=40, help="text tokens after BOS")
    p.add_argument("--labelled", type=int, default=8, help="positions that carry the loss")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps, >= 10 (10)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: a configuration starts only if, at the pace of the longest so far, it "
        "ends within the budget (the first always runs)",
    )
    p.add_argument("--timeout", type=float, default=180.0, help="collective timeout, seconds")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--native-optimizer", choices=("fused", "foreach"), default="fused")
    p.add_argument(
        "--parallax-variants",
        default="opt,base,opt+compile",
        help=f"comma list of parallax variants ({', '.join(VARIANTS)})",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of opt+compile (inductor; aot_eager with --smoke)",
    )
    p.add_argument("--no-write", action="store_true", help="print only, append no results")
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.smoke else "openvla-7b")
    args.global_batch = args.global_batch or (8 if args.smoke else 32)
    if args.single_batch is not None and not 0 < args.single_batch <= args.global_batch:
        p.error(f"--single-batch must be in 1..--global-batch, got {args.single_batch}")
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    if args.steps is None:
        args.steps = 2 if args.smoke else 10
    if args.steps < (1 if args.smoke else 10) or args.warmup < 0:
        p.error(f"--steps must be >= 10 (1 with --smoke) and --warmup >= 0, got {args.steps}")
    if args.smoke:
        args.text_tokens = min(args.text_tokens, 12)
    unknown = set(args.frameworks.split(",")) - set(FRAMEWORKS)
    if unknown:
        p.error(f"unknown --frameworks {sorted(unknown)}; choose from {', '.join(FRAMEWORKS)}")
    args.variants = [v for v in args.parallax_variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or not args.variants:
        p.error(
            f"--parallax-variants {args.parallax_variants!r}: choose from {', '.join(VARIANTS)}"
        )
    args.compile_backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    return args


def init_world(args) -> tuple[torch.device, int, int, dist.ProcessGroup | None]:
    """The default process group (NCCL on GPUs, gloo for --smoke), this rank's device, and a
    gloo group over every rank for the benchmark's own control messages."""
    use_cuda = torch.cuda.is_available() and not args.smoke
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if use_cuda:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world == 1:
        return device, world, rank, None
    timeout = timedelta(seconds=args.timeout)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    return device, world, rank, dist.new_group(backend="gloo", timeout=timeout)


def default_layouts(world: int) -> list[Layout]:
    """The single-axis layouts over every rank, then one device (its rows are run on every rank
    at once, each rank its own replica)."""
    if world == 1:
        return [Layout()]
    return [Layout(tp=world), Layout(pp=world), Layout(dp=world), Layout()]


def agree(flag: bool, control: dist.ProcessGroup | None) -> bool:
    """Rank 0's decision, on every rank."""
    return bool(gather(flag, control)[0])


@dataclass
class Bench:
    """What every configuration of one invocation shares."""

    args: argparse.Namespace
    device: torch.device
    world: int
    rank: int
    control: dist.ProcessGroup | None  # gloo, for the benchmark's own messages
    config: OpenVLAConfig
    batch: dict[str, torch.Tensor]  # the global batch, the same on every rank
    seq: int  # tokens per sample through the language model
    flops_step: float  # the lm_head over every position
    flops_labelled: float  # the lm_head over the labelled positions only
    base: Workload
    info: dict[str, str]
    contexts: dict[str, ParallelContext] = field(default_factory=dict)


def setup(args: argparse.Namespace) -> Bench:
    device, world, rank, control = init_world(args)
    config = OpenVLAConfig.preset(args.model)
    text = 1 + args.text_tokens  # input ids per sample, BOS included
    gb = args.global_batch
    return Bench(
        args=args,
        device=device,
        world=world,
        rank=rank,
        control=control,
        config=config,
        batch=synthetic_batch(config, gb, text, args.labelled, seed=0, device=device),
        seq=config.num_patches + text,
        flops_step=gb * openvla_flops_per_sample(config, text),
        flops_labelled=gb * openvla_flops_per_sample(config, text, logit_positions=args.labelled),
        base=Workload(
            config,
            micro_batch=1,
            autocast=None if args.smoke else torch.bfloat16,
            activation_checkpointing=args.activation_checkpointing,
            optimizer=args.native_optimizer,
        ),
        info=env_info(),
    )


def plan(b: Bench) -> list[tuple[Layout, str, str | None, str | None]]:
    """(layout, framework, parallax variant, reason to skip or None) in running order: the lead
    parallax variant (``opt``) on the multi-GPU layouts, the natives there, the one-GPU rows,
    then the other variants; layouts given with ``--layouts`` run in the order given."""
    layouts = (
        [Layout.parse(x) for x in b.args.layouts.split(",")]
        if b.args.layouts
        else default_layouts(b.world)
    )
    frameworks = b.args.frameworks.split(",")
    variants = b.args.variants
    lead = "opt" if "opt" in variants else variants[0]
    ours = "parallax" in frameworks
    natives = [fw for fw in frameworks if fw != "parallax"]
    multi, single = [x for x in layouts if x.gpus > 1], [x for x in layouts if x.gpus == 1]
    # given --layouts run in the order given (1gpu first: fresh memory, 7B on one GPU is tight)
    groups = [layouts] if b.args.layouts else [multi, single]
    order: list[tuple[Layout, str, str | None]] = []
    for group in groups:
        order += [(x, "parallax", lead) for x in group if ours]
        order += [(x, fw, None) for x in group for fw in natives]
    order += [
        (x, "parallax", v)
        for v in variants
        if v != lead
        for x in [x for group in groups for x in group]
        if ours and (x.dp > 1 or "/gather-sync" not in v)  # dp=1 has no all-gather
    ]
    out = []
    for layout, fw, variant in order:
        if layout.supports(fw):
            fits = layout.gpus in (1, b.world)
            out.append(
                (layout, fw, variant, None if fits else f"skipped: needs {layout.gpus} GPUs")
            )
    return out


def row_flops(b: Bench, fw: str, variant: str | None) -> float:
    """Model FLOPs of one step as this row runs it: parallax variants with labelled logits
    apply the lm_head to the labelled positions only, everything else to all of them."""
    if fw == "parallax" and VARIANTS[variant].get("logits", TrainConfig.logits) == "labelled":
        return b.flops_labelled
    return b.flops_step


def row_batch(b: Bench, layout: Layout) -> int:
    """Samples per step of this layout's rows: ``--single-batch`` on one GPU."""
    if layout.gpus == 1 and b.args.single_batch:
        return b.args.single_batch
    return b.args.global_batch


def measure(
    b: Bench, layout: Layout, fw: str, micro: int, variant: str | None = None, batch: int = 0
) -> dict:
    """Run one configuration on every rank over the first ``batch`` samples (default: all) of
    the global batch; the merged outcome (on every rank)."""
    batch = batch or b.args.global_batch
    try:
        microbatches = split_batch({k: v[:batch] for k, v in b.batch.items()}, micro)
    except ValueError as err:
        return {"error": str(err)}
    wl = replace(b.base, micro_batch=micro)
    free_memory(b.device, reset_peak=True)
    result = run_config(layout, fw, wl, b.args, b.device, microbatches, b.contexts, variant)
    merged = merge(gather(result, b.control))
    free_memory(b.device)
    return merged


def report(b: Bench, rows: list[dict]) -> None:
    args = b.args
    notes = ratio_notes(rows)
    precision = "fp32 (smoke)" if args.smoke else "bf16 compute, fp32 master + AdamW"
    single = f" ({args.single_batch} on one GPU)" if args.single_batch else ""
    title = (
        f"openvla_step: {args.model}, global batch {args.global_batch}{single}, sequence {b.seq} "
        f"(BOS + "
        f"{b.config.num_patches} patches + {args.text_tokens} text), loss on last "
        f"{args.labelled}, {precision}, {b.flops_step / 1e12:.4g} TFLOP per step "
        f"({b.flops_labelled / 1e12:.4g} with the lm_head on the labelled positions only)"
    )
    table = [[r[c] for c in COLUMNS] for r in rows]
    print_table(title, COLUMNS, table, width=220)
    if notes:
        print(notes)
    if not args.no_write:
        how = (
            "MFU = model FLOPs as each row runs them (parallax.train.flops; lm_head on the "
            f"labelled positions for parallax opt, on all for the others) / (step x GPUs x "
            f"{PEAK_TFLOPS:g} TFLOP/s)"
        )
        smoke = "CPU smoke run, sizes scaled down" if args.smoke else ""
        notes = "; ".join(filter(None, [smoke, how, notes]))
        append_results(title, COLUMNS, table, notes=notes, info=b.info)  # the start's commit


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every planned configuration; returns the rows (on rank 0; empty elsewhere)."""
    b = setup(parse_args(argv))
    rows, start, longest, ran = [], time.monotonic(), 0.0, False
    for layout, fw, variant, skip in plan(b):
        micro = b.args.micro_batch or (2 if b.args.smoke or layout.gpus == 1 else 4)
        if skip is None and b.args.time_budget is not None and ran:
            # start only what should end in time, judged by the longest so far
            late = time.monotonic() - start + longest > b.args.time_budget
            skip = "skipped: time budget" if agree(late, b.control) else None
        began = time.monotonic()
        gb = row_batch(b, layout)
        merged = {"error": skip} if skip else measure(b, layout, fw, micro, variant, gb)
        longest, ran = max(longest, time.monotonic() - began), ran or not skip
        if b.rank != 0:
            continue
        flops = row_flops(b, fw, variant) * gb / b.args.global_batch
        row, record = summarise(
            layout, fw, {**merged, "micro": micro}, b.args, flops, b.seq, variant, gb
        )
        rows.append(row)
        status = merged.get("error") or "ok"
        print(f"{layout.name:>6} {fw:<18} {variant or '':<12} step {row['step s']:.4g} s, "
              f"MFU {row['MFU']:.3g}, peak {row['peak GiB']:.3g} GiB: {status}",
              flush=True)  # fmt: skip
        if not skip and not b.args.no_write:
            append_records([record], b.info)
    if b.rank == 0:
        report(b, rows)
    if dist.is_initialized() and b.world > 1:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
