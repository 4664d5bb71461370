"""OpenVLA-7B full fine-tuning steps: parallax against PyTorch's own parallelism, in one run.

Workload: synthetic batches of BOS + 256 image patches + ``--text-tokens`` (40) text tokens, the
loss on the last ``--labelled`` (8) positions (7 action tokens and EOS); bf16 compute, fp32
master weights and fp32 AdamW state everywhere. Every layout that fits the GPUs present runs
(``1gpu``; with 2 GPUs also ``tp2``, ``pp2``, ``dp2``), each under parallax's Trainer and the
PyTorch tools that cover it: ``torch-single`` (1gpu), ``torch-ddp-zero`` and ``torch-fsdp2``
(dp), ``torch-dtensor-tp`` (tp), ``torch-pipelining`` (pp, 1F1B), all on the same model code
and the same global batch (gradient accumulation over micro-batches where it needs it).

The natives run in their best form (``benchmarks.step.native``): ``--native-variants``
``compile`` (the lead: each ViT block and decoder layer ``torch.compile``'d with
``--compile-backend``) and ``eager``; fused AdamW; DDP and FSDP2 reduce gradients once per step
(FSDP2: ``set_requires_gradient_sync(False)`` before the last micro-batch, and with
``--fsdp-unsharded-accumulation`` also ``set_reshard_after_backward(False)``); DTensor TP leaves the
logits sharded over the vocabulary and runs the cross-entropy under ``loss_parallel``; pipelining
sends bf16 activations between stages. A torch that lacks one of these APIs skips the row with the
reason printed (``skipped: ...``), rather than measuring a weaker form.  Every row builds the same
layout-free weights from one seed (parallax in bf16, the natives in fp32) and takes the same batch:
``loss 1``, the first step's loss, must agree across rows within ``--loss-tolerance`` (relative,
default 2^-9, bf16's unit roundoff); ``loss 1 rel diff`` is the difference from the parallax 1gpu
row (or the first parallax row) of the same global batch, and a row beyond the tolerance says so in
its status. ``loss`` is the last step's (after warmup + steps updates on the same batch: it falls
fast and is not comparable across rows).

Per configuration: the median step time over ``--steps`` (>= 10) after ``--warmup``, tokens/s
per GPU (tokens = the 297-token sequence the language model sees), samples/s, model TFLOP/s per
GPU and MFU (``parallax.families.openvla.flops``: 6 x params x tokens per component plus
attention, against 989 TFLOP/s), peak memory per GPU (max over ranks) and, for parallax
pipelines, the bubble measured on a Timeline next to the one simulated from the measured stage
times. The table's ``x best native`` is tokens/s per GPU over the best PyTorch-native
configuration with as many GPUs. Each configuration runs in its own try/except (an OOM becomes
an error row) and writes its JSON line to ``benchmarks/results.jsonl`` as soon as it is
measured; ``--time-budget`` skips what would not finish in time. A configuration that fails on
one rank only leaves its peers waiting in a collective until ``--timeout``.

parallax runs as ``--parallax-variants`` (``variant`` column and JSON key): ``opt`` is the
Trainer's defaults (lm_head on the labelled positions only, fused q/k/v and gate/up, no
per-step pipeline host syncs), ``base`` all of that off, ``opt+compile`` adds ``torch.compile``
of each block. Running order puts what answers the issue first: parallax ``opt`` on the
multi-GPU layouts, the natives there, the one-GPU rows, then the other variants. Each row's
MFU counts the FLOPs it runs (the lm_head over all positions, or the labelled ones).

    torchrun --nproc-per-node 2 -m benchmarks.step.openvla --time-budget 480  # 2 H200
    torchrun --nproc-per-node 2 -m benchmarks.step.openvla --smoke            # CPU, writes nothing

``--smoke``: the ``tiny`` model, gloo, fp32 (CPU autocast to bf16 is slow and not what the GPU
rows run), ``aot_eager`` as the compile backend (inductor works on CPU too, ~2x slower to
compile); it appends nothing to the results files unless ``--write`` is given.

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

from benchmarks.step.native import Workload, split_batch, synthetic_batch
from benchmarks.step.openvla_args import parse_args
from benchmarks.step.openvla_runs import (
    VARIANTS,
    Layout,
    free_memory,
    gather,
    merge,
    run_config,
)
from benchmarks.step.openvla_table import report, summarise
from benchmarks.tools.common import append_records, env_info
from parallax import ParallelContext
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.flops import openvla_flops_per_sample
from parallax.run import TrainConfig
from parallax.train.memory_limit import default_allocator


def init_world(args) -> tuple[torch.device, int, int, dist.ProcessGroup | None, bool]:
    """The default process group (NCCL on GPUs, gloo for --smoke), this rank's device, a gloo
    group over every rank for the benchmark's own control messages, and whether this call
    created the default group (then ``main`` destroys it at the end)."""
    use_cuda = torch.cuda.is_available() and not args.smoke
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if use_cuda:
        default_allocator()  # as parallax.train runs
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world == 1:
        return device, world, rank, None, False
    timeout = timedelta(seconds=args.timeout)
    owns = not dist.is_initialized()  # a test harness may hold the group already
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    return device, world, rank, dist.new_group(backend="gloo", timeout=timeout), owns


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
    owns_world: bool  # this run created the default process group
    config: OpenVLAConfig
    batch: dict[str, torch.Tensor]  # the global batch, the same on every rank
    seq: int  # tokens per sample through the language model
    flops_step: float  # the lm_head over every position
    flops_labelled: float  # the lm_head over the labelled positions only
    base: Workload
    info: dict[str, str]
    contexts: dict[str, ParallelContext] = field(default_factory=dict)


def setup(args: argparse.Namespace) -> Bench:
    device, world, rank, control, owns = init_world(args)
    config = OpenVLAConfig.preset(args.model)
    text = 1 + args.text_tokens  # input ids per sample, BOS included
    gb = args.global_batch
    return Bench(
        args=args,
        device=device,
        world=world,
        rank=rank,
        control=control,
        owns_world=owns,
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
            fsdp_unsharded_accumulation=args.fsdp_unsharded_accumulation,
        ),
        info=env_info(),
    )


def plan(b: Bench) -> list[tuple[Layout, str, str | None, str | None]]:
    """(layout, framework, variant, reason to skip or None) in running order: the lead
    parallax variant (``opt``) on the multi-GPU layouts, the natives there in their lead form
    (the first ``--native-variants``, ``compile``), the one-GPU rows, then the other variants
    of both; layouts given with ``--layouts`` run in the order given."""
    layouts = (
        [Layout.parse(x) for x in b.args.layouts.split(",")]
        if b.args.layouts
        else default_layouts(b.world)
    )
    frameworks = b.args.frameworks.split(",")
    variants, native_variants = b.args.variants, b.args.native_variants
    lead = "opt" if "opt" in variants else variants[0]
    ours = "parallax" in frameworks
    natives = [fw for fw in frameworks if fw != "parallax"]
    multi, single = [x for x in layouts if x.gpus > 1], [x for x in layouts if x.gpus == 1]
    # given --layouts run in the order given (1gpu first: fresh memory, 7B on one GPU is tight)
    groups = [layouts] if b.args.layouts else [multi, single]
    every = [x for group in groups for x in group]
    order: list[tuple[Layout, str, str | None]] = []
    for group in groups:
        order += [(x, "parallax", lead) for x in group if ours]
        order += [(x, fw, native_variants[0]) for x in group for fw in natives]
    order += [
        (x, "parallax", v)
        for v in variants
        if v != lead
        for x in every
        if ours and (x.dp > 1 or "/gather-sync" not in v)  # dp=1 has no all-gather
    ]
    order += [(x, fw, v) for v in native_variants[1:] for x in every for fw in natives]
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


def row_micro_batch(b: Bench, layout: Layout, fw: str) -> int:
    """Samples per micro-batch of this row: ``--native-micro-batch`` for the natives, else
    ``--micro-batch``, else 2 on one GPU (and in smoke runs) and 4 on more."""
    if fw != "parallax" and b.args.native_micro_batch:
        return b.args.native_micro_batch
    return b.args.micro_batch or (2 if b.args.smoke or layout.gpus == 1 else 4)


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


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every planned configuration; returns the rows (on rank 0; empty elsewhere)."""
    b = setup(parse_args(argv))
    rows, start, longest, ran = [], time.monotonic(), 0.0, False
    for layout, fw, variant, skip in plan(b):
        micro = row_micro_batch(b, layout, fw)
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
              f"MFU {row['MFU']:.3g}, peak {row['peak GiB']:.3g} GiB, "
              f"loss 1 {row['loss 1']:.6g}: {status}", flush=True)  # fmt: skip
        if not skip and not b.args.no_write:
            append_records([record], b.info)
    if b.rank == 0:
        report(b, rows)
    if b.owns_world:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
