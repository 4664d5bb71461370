"""The command line of ``parallax.train``: every flag, its group and its help text.

Values arrive as text and are checked against the ``TrainConfig`` field of the same name by
:func:`parallax.train.config.parse_args` (the field annotations are the one source of types).
"""

from __future__ import annotations

import argparse

from parallax.recipe import registry
from parallax.train.config import (
    CHECKPOINT_SCOPES,
    FINETUNES,
    FULL_DEFAULTS,
    LOGITS,
    LORA_DEFAULTS,
    LR_SCHEDULES,
    OFFLOADS,
    PRECISIONS,
    SCHEDULES,
    TrainConfig,
)


class _Parser(argparse.ArgumentParser):
    """Raises its errors instead of printing them, so the CLI decides which rank says them."""

    def error(self, message: str):
        raise ValueError(f"{message} (--help lists the flags)")


def _choices(options: tuple[str, ...]) -> str:
    return "{" + ",".join(options) + "}"


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(
        prog="parallax.train",
        description="Train a model of any registered family (by default a tiny vision-language-"
        "action model on a built-in synthetic robot task) in any "
        "dp x tp x pp layout. Launch with torchrun; flags override --config (TOML).",
    )
    p.add_argument("--config", help="TOML file of flag values (keys as flags, '-' -> '_')")
    g = p.add_argument_group("layout")
    g.add_argument("--tp", help=f"tensor-parallel size (default {d.tp})")
    g.add_argument("--pp", help=f"pipeline stages (default {d.pp})")
    g.add_argument("--dp", help="data-parallel size (default: world / (tp*pp))")
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        help=f"a preset ({', '.join(sorted(registry.presets()))}), a checkpoint dir, or "
        f"FAMILY:SPEC (default {d.model})",
    )
    g.add_argument(
        "--data",
        help="synthetic, a dataset dir (format detected), FORMAT:PATH (rlds, lerobot, libero, "
        f"parallax) or a mixture FORMAT:A@0.7,FORMAT:B@0.3 (default {d.data})",
    )
    g.add_argument(
        "--data-config",
        help="TOML file of per-dataset key configs ([name] tables: cameras, state, action "
        "keys and transforms), for datasets the built-in configs do not know",
    )
    g.add_argument(
        "--workers",
        help="processes that decode and augment robot data per rank (0: in the training "
        "process; default: what the host's cores allow, at most 8)",
    )
    g.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="OpenVLA's training-time image augmentation (default: on for robot datasets, "
        "off for the synthetic task)",
    )
    g.add_argument(
        "--freeze-vision",
        action="store_true",
        default=None,
        help="freeze the vision tower(s): the same as --freeze vision",
    )
    g.add_argument(
        "--freeze",
        help="GLOB,...: freeze the parameters whose global names match (or an alias such as "
        "'vision'); frozen ones get no gradients and no optimizer state",
    )
    g.add_argument(
        "--lr-groups",
        help="GLOB=LR,... or a TOML file of glob = lr: peak learning rates by parameter name "
        "(first match wins; the rest get --lr)",
    )
    g.add_argument("--precision", metavar=_choices(PRECISIONS), help=f"default {d.precision}")
    _lora_flags(p, d)
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each block's activations in the backward pass",
    )
    g.add_argument(
        "--checkpoint-scope",
        metavar=_choices(CHECKPOINT_SCOPES),
        help="with --activation-checkpointing: which blocks recompute: all, vision (the "
        "vision towers alone: under LoRA much of the memory for little of the compute) or "
        f"text (the language model, a dual encoder's text tower) (default {d.checkpoint_scope})",
    )
    g.add_argument(
        "--activation-memory-budget",
        metavar="FRACTION",
        help="with --compile: the share of a compiled block's saved activations to keep; "
        "below 1 the compiler recomputes the cheapest of the rest in the backward (norms, "
        f"activations, then attention) (default {d.activation_memory_budget})",
    )
    g = p.add_argument_group("schedule")
    g.add_argument("--steps", help=f"optimizer steps (default {d.steps})")
    g.add_argument("--global-batch-size", help=f"samples per step (default {d.global_batch_size})")
    g.add_argument(
        "--micro-batch-size",
        help=f"samples per microbatch (default {d.micro_batch_size})",
    )
    g.add_argument(
        "--schedule", metavar=_choices(SCHEDULES), help=f"pipeline schedule (default {d.schedule})"
    )
    g.add_argument("--chunks", help="model chunks per pipeline rank (interleaved)")
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--lr",
        help="peak learning rate (default: the model's, e.g. tiny 1e-3, 7B 2e-5; LoRA 5e-4)",
    )
    g.add_argument("--min-lr", help=f"final lr of the cosine schedule (default {d.min_lr})")
    full, lora = FULL_DEFAULTS, LORA_DEFAULTS
    g.add_argument(
        "--warmup-steps",
        help=f"linear warm-up steps (default {full['warmup_steps']}, LoRA {lora['warmup_steps']})",
    )
    g.add_argument(
        "--lr-schedule",
        metavar=_choices(LR_SCHEDULES),
        help=f"default {full['lr_schedule']}, LoRA {lora['lr_schedule']}",
    )
    g.add_argument(
        "--weight-decay",
        help=f"AdamW weight decay on matrices (default {d.weight_decay})",
    )
    g.add_argument(
        "--grad-clip",
        help=f"global grad-norm clip, 0 = off (default {full['grad_clip']:g}, LoRA off)",
    )
    g.add_argument(
        "--no-overlap",
        dest="overlap_grad_reduce",
        action="store_false",
        default=None,
        help="reduce gradients after the backward instead of during it",
    )
    _memory_flags(p, d)
    g = p.add_argument_group("speed (same results either way)")
    g.add_argument(
        "--logits",
        metavar=_choices(LOGITS),
        help="where the last stage applies the final norm and lm_head: at the labelled "
        f"positions only, inside the loss, or at every position (default {d.logits})",
    )
    g.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="q/k/v and gate/up as one weight each: fewer, larger matmuls; checkpoints keep "
        f"the separate tensors (default {'on' if d.fused_projections else 'off'})",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each ViT block and decoder layer (the first steps compile)",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="with --compile on GPUs: replay each compiled block as a CUDA graph "
        "(torch.compile's reduce-overhead mode; fewer kernel launches on the host)",
    )
    g.add_argument(
        "--pipeline-syncs",
        action="store_true",
        default=None,
        help="agree on the pipeline program every step and size received activations from "
        "their metadata (host syncs); default: agree once, sizes from the batch",
    )
    g.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at dp > 1, let the ZeRO all-gather of updated weights run under the next "
        "forward, each block waiting for its own weights "
        f"(default {'on' if d.overlap_param_gather else 'off'})",
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", help=f"seed of weights and data (default {d.seed})")
    g.add_argument("--out", help=f"output dir: metrics.jsonl, checkpoints/ (default {d.out})")
    g.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the latest checkpoint in --out (any layout)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="delete the checkpoints and metrics of another run in --out first (a fresh run "
        "refuses such a folder without --resume or --overwrite)",
    )
    g.add_argument(
        "--save-interval",
        help=f"checkpoint every N steps and at the end; 0: never (default {d.save_interval})",
    )
    g.add_argument("--keep-last", help=f"checkpoints to keep (default {d.keep_last})")
    g.add_argument("--log-interval", help=f"print every N steps (default {d.log_interval})")
    g.add_argument("--timeout", help=f"collective timeout in seconds (default {d.timeout:g})")
    g.add_argument(
        "--export-hf",
        action="store_true",
        default=None,
        help="also write the final weights in the family's Hugging Face layout to --out/hf",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        default=None,
        help="print the plan (layout, stages, memory, schedule) and exit",
    )
    g = p.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval",
        help="evaluate on the held-out split every N steps and at the end; 0: never (default 0)",
    )
    g.add_argument(
        "--eval-batches",
        help=f"global batches per evaluation, the same ones each time (default {d.eval_batches})",
    )
    g.add_argument(
        "--eval-data",
        help="the held-out split for a dataset dir (synthetic tasks use episodes of another seed)",
    )
    return p


def _memory_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("memory (same results either way)")
    g.add_argument(
        "--zero",
        metavar="{1,2,3}",
        help="ZeRO stage within each (pp, tp) position's dp group: 1 shards the optimizer "
        "state, 2 also the reduced gradients (reduce-scattered every microbatch), 3 also the "
        f"weights (each block gathered just before use, the next prefetched) (default {d.zero})",
    )
    g.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --zero 3: free each block's gathered weights after its forward and gather "
        "them again for its backward (off: keep them from the first forward until the step, "
        "one all-gather per block per step for the whole stage's weights in memory) "
        f"(default {'on' if d.reshard_after_forward else 'off'})",
    )
    g.add_argument(
        "--offload",
        metavar=_choices(OFFLOADS),
        help="optimizer: keep this rank's fp32 masters and AdamW moments in (pinned) host "
        "memory and step them there, bucket by bucket, as the backward reduces them "
        f"(default {d.offload})",
    )
    g.add_argument(
        "--offload-fraction",
        metavar="F",
        help="with --offload optimizer: the share of the buckets whose state lives on the "
        f"host; the rest stays on the GPU (default {d.offload_fraction:g})",
    )
    g.add_argument(
        "--gpu-memory-limit",
        metavar="GIB",
        help="cap this process's GPU memory (emulates a smaller card; an out-of-memory error "
        "then names the options that would help); ignored on the CPU",
    )


def _lora_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("LoRA (OpenVLA's fine-tuning recipe by default)")
    g.add_argument(
        "--finetune",
        metavar=_choices(FINETUNES),
        help="full: train every parameter not frozen; lora: train low-rank adapters on the "
        "frozen base (no gradients, masters or optimizer state for it), with lr 5e-4 constant, "
        f"no warm-up and no clipping unless given (default {d.finetune})",
    )
    g.add_argument("--lora-rank", help=f"adapter rank r (default {d.lora_rank})")
    g.add_argument("--lora-alpha", help=f"adapter scale alpha / r (default {d.lora_alpha:g})")
    g.add_argument(
        "--lora-dropout", help=f"dropout on the adapters' input (default {d.lora_dropout:g})"
    )
    g.add_argument(
        "--lora-targets",
        help="'all-linear' (every linear but the output head) or GLOB,... of module names, "
        f"parallax's or the HF checkpoint's, whole or as a dotted tail (default {d.lora_targets})",
    )
    g.add_argument(
        "--train",
        help="GLOB,...: modules (or parameters) trained fully beside the adapters, e.g. "
        "projector,*norm (PEFT's modules_to_save); give them their own lr with --lr-groups",
    )
    g.add_argument("--lora-init", help="DIR: start from this PEFT adapter (adapter_config.json)")
