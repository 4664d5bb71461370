"""LLaVA-NeXT-7B (LLaVA-v1.6-Vicuna-7B) full fine-tuning steps on one GPU: parallax against a
plain-torch model and Hugging Face's ``LlavaNextForConditionalGeneration``.

Workload (:mod:`benchmarks.step.llava_workload`): a realistic image mix (mostly 640x480 and
1024x768; 2.3k image tokens per sample on average) with 60-140 text tokens per sample, the answer
(20-60 tokens and EOS) supervised; the global batch (``--global-batch``) is grouped by length and
cut into microbatches of ``--micro-batch-size``, the same for every row. Full fine-tuning in bf16
with fp32 master weights, AdamW at LLaVA-v1.6's rates (CLIP tower 2e-6, projector and language model
2e-5), gradient clipping at 1.0 (:mod:`benchmarks.step.llava_rows`).

Rows (``--frameworks``, each its own command on one H200, so three 7B models never share the
GPU): ``parallax`` (the Trainer; ``--parallax-variant opt`` is its defaults, ``opt+compile``
adds ``torch.compile`` of each ViT block and decoder layer), ``torch`` (plain torch modules,
:mod:`benchmarks.step.llava_native`; ``--native-variant compile`` compiles each layer, fused AdamW)
and ``hf`` (transformers' model with SDPA attention and an attention mask for the padding;
skipped when transformers is not importable). Every row starts from the same weights
(parallax's init of ``--seed`` rounded to bf16), so ``loss 1`` (the first step's global-batch
loss) must agree across rows within bf16 noise.

Reported per row: the median step time over ``--steps`` after ``--warmup``, samples/s, tokens/s per
GPU (real text and image tokens; padding not counted), model TFLOP/s and MFU against 989 TFLOP/s.
FLOPs (:mod:`parallax.families.llava_next.flops`): per sample 3 x the forward of the CLIP tower on
its real tiles (blocks 0..22 over 577 tokens, attention ``4 n^2 w``), of the projector and of the
Llama layers over its real tokens (``2 x params x tokens`` plus causal attention ``2 S^2 h`` per
layer) and the lm_head over the positions the row computes (parallax: the labelled ones; the others:
every position); padding and the CLIP layers after the feature layer are not useful work and are not
counted. Also the peak memory and the share of padded token positions in the microbatches.

    python -m benchmarks.step.llava --frameworks parallax --parallax-variant opt+compile
    python -m benchmarks.step.llava --frameworks torch --activation-checkpointing
    python -m benchmarks.step.llava --frameworks hf --activation-checkpointing
    python -m benchmarks.step.llava --smoke     # llava-tiny on the CPU, writes nothing

``--smoke`` runs ``llava-tiny`` in fp32 on the CPU (``aot_eager`` for compile) and appends to
the results files only with ``--write``.
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch

from benchmarks.step.llava_rows import ROWS
from benchmarks.step.llava_workload import microbatches, padding_fraction, samples, step_flops
from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    append_results,
    env_info,
    median,
    peak_memory_gib,
    print_table,
    sync,
)
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.train.memory_limit import default_allocator

COLUMNS = [
    "framework",
    "variant",
    "batch",
    "micro",
    "step s",
    "samples/s",
    "tokens/s/GPU",
    "TFLOP/s",
    "MFU",
    "peak GiB",
    "padding",
    "loss 1",
    "loss",
    "status",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="parallax,torch,hf", help="parallax, torch, hf")
    p.add_argument("--model", default=None, help="default llava-v1.6-vicuna-7b (smoke: tiny)")
    p.add_argument("--global-batch", type=int, default=None, help="default 8 (smoke: 4)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 1 (smoke: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; smoke 1)")
    p.add_argument("--parallax-variant", default="opt+compile", choices=["opt", "opt+compile"])
    p.add_argument("--native-variant", default="compile", choices=["eager", "compile"])
    p.add_argument("--compile-backend", default=None, help="default inductor (smoke: aot_eager)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="llava-tiny on the CPU, fp32")
    p.add_argument("--write", action="store_true", help="with --smoke: append the results")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = dict(
        model="llava-tiny" if smoke else "llava-v1.6-vicuna-7b",
        global_batch=4 if smoke else 8,
        micro_batch_size=2 if smoke else 1,
        steps=2 if smoke else 5,
        warmup=1 if smoke else 2,
        compile_backend="aot_eager" if smoke else "inductor",
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in args.frameworks if f not in ROWS]
    if unknown:
        p.error(f"--frameworks: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.global_batch % args.micro_batch_size:
        p.error("--global-batch must be a multiple of --micro-batch-size")
    return args


def variant(args, framework: str) -> str:
    ac = "+ac" if args.activation_checkpointing else ""
    if framework == "parallax":
        return args.parallax_variant + ac
    return ("eager" if framework == "hf" else args.native_variant) + ac


def run_row(args, framework, config, mbs, device) -> dict:
    """One row, its own failures caught (an OOM or a missing package becomes its status)."""
    row = {c: math.nan for c in COLUMNS}
    row.update(framework=framework, variant=variant(args, framework), status="ok")
    row.update(batch=args.global_batch, micro=args.micro_batch_size)
    flops = step_flops(config, mbs, labelled_logits=framework == "parallax")
    tokens = sum(int(mb["lengths"].sum()) for mb in mbs)
    row["padding"] = padding_fraction(mbs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step, row["loss 1"] = ROWS[framework](args, config, mbs, device)
        for _ in range(max(args.warmup - 1, 0)):  # the first step was the first warm-up
            step()
        times = []
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            row["loss"] = step()
            times.append(time.perf_counter() - t0)
        s = median(times)
        row.update({"step s": s, "samples/s": args.global_batch / s, "tokens/s/GPU": tokens / s})
        row["TFLOP/s"] = flops / s / 1e12
        row["MFU"] = row["TFLOP/s"] / PEAK_BF16_TFLOPS
        row["peak GiB"] = peak_memory_gib(device)
    except Exception as err:  # noqa: BLE001 - a failing row is reported, the others still run
        text = str(err).split("\n")[0][:160]
        row["status"] = text if text.startswith("skipped") else f"error: {type(err).__name__}"
        if not text.startswith("skipped"):
            row["status"] += f": {text}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    info = env_info()
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        default_allocator()  # as parallax.train runs
    device = torch.device("cuda" if cuda else "cpu")
    config = LlavaNextConfig.preset(args.model)
    plans = samples(config, args.global_batch, seed=args.seed)
    mbs = microbatches(config, plans, args.micro_batch_size, seed=args.seed)
    rows = [run_row(args, fw, config, mbs, device) for fw in args.frameworks]
    for r in rows:
        print(f"{r['framework']} {r['variant']}: first-step loss {r['loss 1']:.6f} ({r['status']})")
    image = sum(p["image_tokens"] for p in plans) / len(plans)
    text = sum(int(mb["lengths"].sum()) for mb in mbs) / len(plans) - image
    title = f"LLaVA-NeXT step: {args.model}, one GPU, full fine-tuning (vision lr 2e-6)"
    notes = (
        f"{image:.0f} image + {text:.0f} text tokens per sample (image mix of "
        "benchmarks/step/llava_workload.py), grouped by length; bf16 with fp32 master weights; "
        "MFU "
        f"vs {PEAK_BF16_TFLOPS:.0f} TFLOP/s, FLOPs of parallax.families.llava_next.flops on real "
        "tokens "
        "and tiles (padding not counted); loss 1 = first step's global-batch loss, same weights "
        "in every row"
    )
    table = [[r[c] for c in COLUMNS] for r in rows]
    print_table(title, COLUMNS, table, width=220)
    print(notes)
    if not args.smoke or args.write:
        records = [
            {
                "benchmark": "llava_step",
                "gpus": 1,
                "framework": r["framework"],
                "variant": r["variant"],
                "global_batch": r["batch"],
                "micro_batch": r["micro"],
                "step_time_s": _finite(r["step s"]),
                "samples_per_s": _finite(r["samples/s"]),
                "tokens_per_s_per_gpu": _finite(r["tokens/s/GPU"]),
                "mfu": _finite(r["MFU"]),
                "peak_mem_gib": _finite(r["peak GiB"]),
                "padding": _finite(r["padding"]),
                "first_loss": _finite(r["loss 1"]),
                "status": r["status"],
            }
            for r in rows
        ]
        append_results(title, COLUMNS, table, notes=notes, records=records, info=info)
    return rows


def _finite(x) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


if __name__ == "__main__":
    main()
