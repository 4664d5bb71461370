"""The command line of ``benchmarks.step.openvla`` (its flags and their smoke defaults)."""

from __future__ import annotations

import argparse

from benchmarks.step.openvla_runs import FRAMEWORKS, NATIVE_VARIANTS, VARIANTS

DESCRIPTION = "OpenVLA-7B full fine-tuning steps: parallax against PyTorch's own parallelism."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, fp32, small sizes")
    p.add_argument("--model", default=None, help="openvla-7b (default), small, tiny (smoke)")
    p.add_argument("--layouts", default=None, help="comma list, e.g. 1gpu,tp2,pp2,dp2")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma list")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (32)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 2 on 1 GPU, else 4")
    p.add_argument(
        "--native-micro-batch",
        type=int,
        default=None,
        help="micro-batch of the native rows (default: --micro-batch): torch-single holds 16 "
        "B/param of fp32 state on one GPU and fits only a smaller micro-batch than parallax",
    )
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
        "--native-variants",
        default=",".join(NATIVE_VARIANTS),
        help="comma list of the natives' forms: compile (each ViT block and decoder layer "
        "torch.compile'd with --compile-backend), eager; the first runs beside parallax's lead "
        "variant, the others after",
    )
    p.add_argument(
        "--fsdp-unsharded-accumulation",
        action="store_true",
        help="FSDP2 keeps its parameters gathered between one step's micro-batches (no "
        "all-gather per micro-batch; the whole model's bf16 weights on every GPU)",
    )
    p.add_argument(
        "--loss-tolerance",
        type=float,
        default=None,
        help="relative difference of a row's first-step loss from the reference row's (parallax "
        "1gpu) above which the row is marked (default 2^-9 = 1.95e-3, bf16's unit roundoff; "
        "1e-4 with --smoke in fp32)",
    )
    p.add_argument(
        "--parallax-variants",
        default="opt,base,opt+compile",
        help=f"comma list of parallax variants ({', '.join(VARIANTS)})",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of parallax's +compile variants and the natives' compile "
        "(inductor; aot_eager with --smoke)",
    )
    p.add_argument("--no-write", action="store_true", help="print only, append no results")
    p.add_argument(
        "--write",
        action="store_true",
        help="append the rows of a --smoke run too (by default a smoke run writes nothing)",
    )
    args = p.parse_args(argv)
    args.no_write = args.no_write or (args.smoke and not args.write)
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
    args.native_variants = [v for v in args.native_variants.split(",") if v]
    unknown = set(args.native_variants) - set(NATIVE_VARIANTS)
    if unknown or not args.native_variants:
        p.error(f"--native-variants: choose from {', '.join(NATIVE_VARIANTS)}")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    if args.loss_tolerance is None:
        args.loss_tolerance = 1e-4 if args.smoke else 2.0**-9
    return args
