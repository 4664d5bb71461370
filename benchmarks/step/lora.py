"""OpenVLA-7B with OpenVLA's LoRA recipe on one GPU: parallax against the stack its script runs.

The recipe: LoRA r 32, alpha 16, dropout 0, gaussian init, on every linear but ``lm_head``
(towers and projector included), AdamW 5e-4 constant, no clipping, the base frozen in bf16.
The workload of ``benchmarks/step/openvla.py``: synthetic batches of BOS + 256 patches + 40
text tokens, the loss on the last 8 (one forward of the whole batch, as the script runs a batch
of 16 per GPU; ``--micro-batch`` accumulates smaller ones, as its ``grad_accumulation_steps``
does, for both stacks). Rows (``--stack``):

- ``parallax``: the Trainer with ``--finetune lora`` (bf16 base, fp32 adapters as their own ZeRO
  masters, no gradients or optimizer state for the base, the lm_head on the labelled rows);
  ``--compile``: each ViT block and decoder layer ``torch.compile``'d (``opt+compile``).
- ``hf``: :mod:`benchmarks.step.lora_hf`, timm + transformers + PEFT under bf16 autocast, as the
  script runs it (``eager``) and with ``--compile`` (each block compiled after PEFT).
- ``--cuda-graphs`` (with ``--compile``, either stack): the compiled blocks replayed as CUDA
  graphs (inductor's reduce-overhead mode; parallax's ``--cuda-graphs``), ``+cudagraphs``;
  ``--activation-checkpointing`` (parallax): each block recomputed in the backward, ``+ac``
  (MFU still counts the step's model FLOPs, without the recomputation), with
  ``--checkpoint-scope vision`` the towers alone, ``+ac-vision``;
  ``--activation-memory-budget F`` (with ``--compile``, either stack): the compiler keeps at most
  F of each block's saved activations and recomputes the cheapest others, ``+budgetF``.

``--batch 16,64,max``: each batch in turn in one process (the model built once); ``max`` doubles
the batch from the last one given until a step runs out of memory, then bisects (to a multiple
of 8) and times the largest that fits. A batch that does not fit is an ``OOM`` row.

MFU: model FLOPs of the LoRA step (:func:`parallax.models.lora_flops.openvla_lora_flops`: per
weight 2NT forward, 2NT input gradient where something trainable lies upstream, 2NT weight
gradient only for what trains, so ~4 x params x tokens for the frozen base where full fine-
tuning counts 6; the adapters at 6 x theirs; attention products; the lm_head over the positions
the row computes: the labelled 8 for parallax, all 297 for HF) / (step time x 989 TFLOP/s).
Under ``torchrun --nproc-per-node N`` the parallax row runs at dp N (ZeRO-1 over the adapters;
``--batch`` per GPU, samples/s per GPU against the one-GPU rows). Each row is appended to
``results.jsonl`` as measured (with ``--session``); ``--report SESSION`` writes the session's
rows as one table to ``RESULTS.md`` with the ratios against the faster HF row of the same batch
(samples/s, and peak memory).

    python -m benchmarks.step.lora --stack parallax --batch 16,max,64 --micro-batch 16 \
        --session S
    python -m benchmarks.step.lora --stack parallax --compile --batch 16,64 \
        --micro-batch 16 ...
    python -m benchmarks.step.lora --stack hf --batch 16,max,64 --micro-batch 16 --session S
    python -m benchmarks.step.lora --stack hf --compile --batch 16,64 --micro-batch 16 ...
    torchrun --nproc-per-node 2 -m benchmarks.step.lora --batch 16 --session S  # dp2, per GPU
    python -m benchmarks.step.lora --report S
    python -m benchmarks.step.lora --smoke            # CPU, tiny, writes nothing

``--smoke``: the ``tiny`` model in fp32 on the CPU (the HF row is skipped with a message where
timm, transformers or peft are missing); nothing is written unless ``--write``.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch

from benchmarks.step.lora_report import report
from benchmarks.step.native import split_batch, synthetic_batch
from benchmarks.step.timing import free_memory, time_steps
from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    append_records,
    env_info,
    median,
    peak_memory_gib,
)
from parallax.families.openvla.config import OpenVLAConfig
from parallax.models.compile import CHECKPOINT_SCOPES, memory_budget
from parallax.recipe import resolve
from parallax.train.memory_limit import default_allocator

RANK, ALPHA, LR = 32, 16.0, 5e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32")
    p.add_argument("--stack", choices=("parallax", "hf"), default="parallax")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--cuda-graphs", action="store_true", help="with --compile: CUDA graphs")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="parallax: recompute blocks"
    )
    p.add_argument(
        "--checkpoint-scope",
        choices=CHECKPOINT_SCOPES,
        default="all",
        help="with --activation-checkpointing: which blocks recompute (parallax)",
    )
    p.add_argument(
        "--activation-memory-budget", type=float, default=1.0, help="with --compile (both)"
    )
    p.add_argument(
        "--quantize-base",
        choices=("nf4", "int8"),
        default=None,
        help="the frozen base quantized: parallax's --quantize-base; hf: bitsandbytes 4-bit "
        "NF4 with double quantization (nf4 only), as OpenVLA's --use_quantization loads it",
    )
    p.add_argument(
        "--gpu-memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="cap this process's GPU memory (both stacks), as parallax's --gpu-memory-limit",
    )
    p.add_argument("--batch", default=None, help="comma list of batches, or max (16)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="accumulate micro-batches of this size (default: the whole batch at once; max: "
        "always the whole batch)",
    )
    p.add_argument("--max-batch", type=int, default=None, help="cap of max's search (512)")
    p.add_argument("--model", default=None, help="openvla-7b (default), tiny (smoke)")
    p.add_argument("--text-tokens", type=int, default=40)
    p.add_argument("--labelled", type=int, default=8)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (3; compile 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (10)")
    p.add_argument("--session", default=None, help="tag of the rows one --report collects")
    p.add_argument("--report", default=None, metavar="SESSION", help="write the table")
    p.add_argument("--write", action="store_true", help="with --smoke: write the results")
    args = p.parse_args(argv)
    if args.cuda_graphs and not args.compile:
        p.error("--cuda-graphs replays compiled blocks: add --compile")
    if args.checkpoint_scope != "all" and not args.activation_checkpointing:
        p.error("--checkpoint-scope picks the blocks --activation-checkpointing recomputes")
    if args.activation_checkpointing and args.stack != "parallax":
        p.error("--activation-checkpointing is a parallax row's option")
    if args.stack == "hf" and args.quantize_base == "int8":
        p.error("the hf row quantizes as OpenVLA's script does: --quantize-base nf4")
    args.model = args.model or ("tiny" if args.smoke else "openvla-7b")
    args.batch = args.batch or ("2,4" if args.smoke else "16")
    args.max_batch = args.max_batch or (8 if args.smoke else 512)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.compile else 3)
    args.steps = args.steps or (2 if args.smoke else 10)
    return args


class Row:
    """One stack built once; ``step(batch)`` makes a step function for a batch size."""

    def __init__(self, args, config: OpenVLAConfig, ctx) -> None:
        self.args, self.config, self.ctx, self.device = args, config, ctx, ctx.device
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.trainer = self.model = None
        if args.stack == "hf":
            from benchmarks.step import lora_hf

            self.model, self.optimizer = lora_hf.build(
                config,
                self.device,
                self.dtype,
                RANK,
                ALPHA,
                args.compile,
                args.cuda_graphs,
                quantize=args.quantize_base == "nf4",
            )

    def _trainer(self, n_micro: int, micro: int):
        from parallax.run import TrainConfig
        from parallax.train.trainer import Trainer

        if self.trainer is None or self.trainer.num_microbatches != n_micro:
            self.trainer = None
            free_memory(self.device)
            cfg = TrainConfig(
                model=self.args.model,
                finetune="lora",
                lora_rank=RANK,
                lora_alpha=ALPHA,
                precision="fp32" if self.args.smoke else "bf16",
                dp=self.ctx.dp_size,
                global_batch_size=n_micro * micro * self.ctx.dp_size,  # the batch per GPU
                micro_batch_size=micro,
                lr=LR,
                compile=self.args.compile,
                cuda_graphs=self.args.cuda_graphs,
                activation_checkpointing=self.args.activation_checkpointing,
                checkpoint_scope=self.args.checkpoint_scope,
                activation_memory_budget=self.args.activation_memory_budget,
                quantize_base=self.args.quantize_base,
                out=tempfile.mkdtemp(prefix="parallax-lora-bench-"),  # nothing is written
            )
            backend = "aot_eager" if self.args.smoke else "inductor"
            self.trainer = Trainer(resolve(cfg), self.ctx, compile_options={"backend": backend})
        return self.trainer

    def step(self, batch: dict, micro: int):
        """The step function of one batch in micro-batches of ``micro`` (accumulated)."""
        mbs = split_batch(batch, micro)
        if self.args.stack == "hf":
            from benchmarks.step import lora_hf

            autocast = None if self.args.smoke else torch.bfloat16
            step = lora_hf.step_fn(self.model, self.optimizer, mbs, autocast, self.args.cuda_graphs)
            budget = self.args.activation_memory_budget

            def hf_step():
                with memory_budget(budget):  # its blocks compile in the first steps
                    return step()

            return hf_step
        trainer = self._trainer(len(mbs), micro)  # one micro-batch of any size: reused
        mbs = [{**mb, "labels": mb["labels"].cpu()} for mb in mbs]
        return lambda: trainer.train_step(mbs)


def lora_flops_per_sample(config: OpenVLAConfig, text: int, logit_positions: int) -> float:
    """:func:`openvla_lora_flops` of the recipe on the whole model (meta, no values)."""
    from parallax.families.openvla.lora_flops import openvla_lora_flops
    from parallax.families.openvla.model import OpenVLA
    from parallax.tensor.lora_apply import apply_lora

    model = OpenVLA(config, None, device="meta")
    apply_lora(model, rank=RANK, alpha=ALPHA, seed=None)
    return openvla_lora_flops(model, text, logit_positions)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def measure(row: Row, args, batch_size: int, micro: int, steps: int, warmup: int) -> dict:
    """Seconds per step, first loss and peak memory at one batch size; ``{"error": ...}``."""
    batch = synthetic_batch(
        row.config, batch_size, 1 + args.text_tokens, args.labelled, seed=0, device=row.device
    )
    free_memory(row.device, reset_peak=True)
    try:
        times, first, _ = time_steps(row.step(batch, micro), row.device, warmup, steps)
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if not _is_oom(err):
            raise
        if row.model is not None:  # a half-done backward's gradients
            row.model.zero_grad(set_to_none=True)
        return {"error": "OOM"}
    finally:
        batch = None
        free_memory(row.device)
    return {"step_s": median(times), "first_loss": first, "peak": peak_memory_gib(row.device)}


def find_max(row: Row, args, start: int) -> int:
    """The largest batch (a multiple of 8 past 8) whose step fits, searched with one step each."""
    fits, fails, b = 0, None, start
    while b <= args.max_batch and fails is None:
        if "error" in measure(row, args, b, b, steps=1, warmup=1):
            fails = b
        else:
            fits, b = b, 2 * b
    step = 8 if not args.smoke else 1
    while fails is not None and fails - fits > step:
        mid = (fits + fails) // 2 // step * step or fits + step
        if "error" in measure(row, args, mid, mid, steps=1, warmup=1):
            fails = mid
        else:
            fits = mid
    return fits


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":  # before the first allocation: against fragmentation after OOMs
        default_allocator()  # as parallax.train runs
        if args.gpu_memory_limit:  # both stacks under the same cap (the parallax.train rule)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(args.gpu_memory_limit * 2**30 / total)
    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # a small CPU shared with others: threads only contend
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and (args.stack != "parallax" or "max" in args.batch.split(",")):
        reason = f"skipped: at {world} ranks only --stack parallax with given batches runs"
        print(reason, flush=True)  # every rank alike, before any collective
        return [{"stack": args.stack, "status": reason}]
    try:
        return _run(args, device, world)
    finally:
        torch.set_num_threads(threads)
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _context(args, device: torch.device, world: int):
    """One process, or ``dp = WORLD_SIZE`` under torchrun (the batch is per GPU)."""
    from parallax import ParallelContext
    from parallax.context import init_parallel

    if world == 1:
        return ParallelContext.local(device=device)
    return init_parallel(dp=world, backend="gloo" if args.smoke else None)


def _run(args, device: torch.device, world: int) -> list[dict]:
    config = OpenVLAConfig.preset(args.model)
    info, rows = env_info(), []
    variant = ("compile" if args.compile else "eager") if args.stack == "hf" else "opt"
    if args.stack == "parallax" and args.compile:
        variant = "opt+compile"
    if args.cuda_graphs:
        variant += "+cudagraphs"
    if args.activation_checkpointing:
        scope = args.checkpoint_scope
        variant += "+ac" if scope == "all" else f"+ac-{scope}"
    if args.activation_memory_budget < 1:
        variant += f"+budget{args.activation_memory_budget:g}"
    if args.quantize_base:
        variant += f"+{args.quantize_base}"
    if args.gpu_memory_limit:
        variant += f" <= {args.gpu_memory_limit:g} GiB"
    if world > 1:
        variant += f" dp{world}"
    if args.stack == "hf":
        from benchmarks.step import lora_hf

        reason = lora_hf.missing(args.quantize_base == "nf4")
        if reason:
            print(f"hf {variant}: {reason}", flush=True)
            return [{"stack": "hf", "variant": variant, "status": reason}]
    seq = config.num_patches + 1 + args.text_tokens
    positions = args.labelled if args.stack == "parallax" else seq
    per_sample = lora_flops_per_sample(config, 1 + args.text_tokens, positions)
    ctx = _context(args, device, world)
    row, last = Row(args, config, ctx), 16
    for item in args.batch.split(","):
        began = time.monotonic()
        label, b = item, 0
        if item == "max":
            b = find_max(row, args, last)
            label = f"max={b}"
        else:
            b = last = int(item)
        micro = b if item == "max" else min(args.micro_batch or b, b)
        if b:
            got = measure(row, args, b, micro, args.steps, args.warmup)
        else:
            got = {"error": "none fits"}
        step_s = got.get("step_s", math.nan)
        rec = {
            "benchmark": "lora_step",
            "session": args.session or info["run_id"],
            "stack": args.stack,
            "variant": variant,
            "gpus": world,
            "model": args.model,
            "batch": b,
            "batch_label": label,
            "micro": micro,
            "step_time_s": step_s,
            "samples_per_s_per_gpu": b / step_s,
            "tokens_per_s_per_gpu": b * seq / step_s,
            "tflops_per_gpu": b * per_sample / step_s / 1e12,
            "mfu": b * per_sample / step_s / (PEAK_BF16_TFLOPS * 1e12),
            "peak_mem_gib": got.get("peak", math.nan),
            "first_loss": got.get("first_loss", math.nan),
            "flops_per_sample": per_sample,
            "status": got.get("error", "ok"),
        }
        rows.append(rec)
        if ctx.rank != 0:
            continue
        print(
            f"{args.stack} {variant} batch {label}: step {step_s:.4g} s, "
            f"{rec['samples_per_s_per_gpu']:.4g} samples/s, MFU {rec['mfu']:.3g}, peak "
            f"{rec['peak_mem_gib']:.3g} GiB, loss 1 {rec['first_loss']:.5g} "
            f"({rec['status']}, {time.monotonic() - began:.0f} s)",
            flush=True,
        )
        if not args.smoke or args.write:
            append_records([rec], info)
    return rows


if __name__ == "__main__":
    main()
