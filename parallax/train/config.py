"""Training options: one frozen dataclass, each field declared once with :func:`opt`.

A field's declaration is its flag (``--global-batch-size``), its TOML key (``global_batch_size``
or ``global-batch-size`` in a ``--config`` file; flags given on the command line win), its
default, help text, ``--help`` group and checks (:mod:`parallax.train.options`). Cross-option
rules are :data:`RULES` in :mod:`parallax.train.rules`. Defaults do not depend on the layout, so
the same command trains the same model at every ``dp x tp x pp``. ``None`` means "the family
decides" (the learning rate, its schedule, the lr groups): :func:`parallax.train.run.resolve`
fills those in, once, into the frozen :class:`~parallax.train.run.Run` the rest of a run reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.models.compile import CHECKPOINT_SCOPES
from parallax.recipe.registry import preset_names
from parallax.train.options import at_least, opt, positive, within
from parallax.train.rules import config_problems

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine", "step")
ACTION_HEADS = ("tokens", "l1")
OFFLOADS = ("none", "optimizer")
ZERO_STAGES = (1, 2, 3)
LOGITS = ("labelled", "all")
FINETUNES = ("full", "lora")
# what ``None`` means for the optimisation flags: full fine-tuning's defaults, and OpenVLA's LoRA
# recipe (5e-4 constant, no warm-up, no clipping; ``lr`` from the recipe, Recipe.default_lr)
FULL_DEFAULTS = {"warmup_steps": 20, "lr_schedule": "cosine", "grad_clip": 1.0}
LORA_DEFAULTS = {"warmup_steps": 0, "lr_schedule": "constant", "grad_clip": 0.0}

LAYOUT, DATA, LORA, SCHEDULE = "layout", "model and data", "LoRA", "schedule"
ACTIONS = "actions"
OPTIM, MEMORY, SPEED, RUN, EVAL = (
    "optimisation",
    "memory",
    "speed (same results either way)",
    "run",
    "evaluation",
)
ONE = at_least(1)
LORA_ONLY = {"needs": ("finetune", "lora")}  # the LoRA options mean nothing without it
AUTO_ONLY = {"needs": ("layout", "auto", "what the planner plans for")}
LAYOUTS = ("manual", "auto")
INTERCONNECTS = ("nvlink", "pcie", "pcie-no-p2p")


def _zero_stage(stage: int) -> str | None:
    return None if stage in ZERO_STAGES else f"must be 1, 2 or 3, got {stage}"


def _adapter_dir(path: str) -> str | None:
    return None if Path(path).is_dir() else "no such adapter directory"


def _nonempty_globs(text: str) -> str | None:
    return None if text.strip(", ") else "must be 'all-linear' or module-name globs"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run is told; saved into every checkpoint (``to_dict``)."""

    config: str | None = opt(
        None, "TOML file of flag values (keys as flags, '-' or '_')", RUN, metavar="FILE"
    )
    # -- layout
    tp: int = opt(1, "tensor-parallel size", LAYOUT, check=ONE)
    pp: int = opt(1, "pipeline stages", LAYOUT, check=ONE)
    dp: int | None = opt(
        None, "data-parallel size", LAYOUT, check=ONE, default_text="world/(tp*pp)"
    )
    layout: str = opt(
        "manual",
        "auto: run the planner's fastest layout that fits the GPUs (python -m parallax.plan) and "
        "print it; --tp, --pp, --dp, --micro-batch-size, --schedule, --chunks, memory options "
        "given beside it constrain the search",
        LAYOUT,
        choices=LAYOUTS,
    )
    gpu_memory: float | None = opt(
        None,
        "GiB of each GPU that --layout auto plans for",
        LAYOUT,
        check=positive,
        metavar="GIB",
        default_text="the device's",
        **AUTO_ONLY,
    )
    host_memory: float | None = opt(
        None,
        "GiB of host memory per node that --layout auto plans for",
        LAYOUT,
        check=positive,
        metavar="GIB",
        default_text="this host's",
        **AUTO_ONLY,
    )
    interconnect: str | None = opt(
        None,
        "how a node's GPUs talk, for --layout auto",
        LAYOUT,
        choices=INTERCONNECTS,
        default_text="NVLink on data-centre GPUs, PCIe without peer-to-peer below 70 GiB",
        **AUTO_ONLY,
    )
    machine: str | None = opt(
        None,
        "a measured machine profile for --layout auto (python -m parallax.plan calibrate "
        "--out FILE)",
        LAYOUT,
        metavar="FILE",
        **AUTO_ONLY,
    )
    layout_given: str | None = opt(
        None,
        "the options given beside --layout auto (the command line fills it in)",
        LAYOUT,
        hidden=True,
    )
    # -- model and data
    model: str = opt(
        "tiny",
        f"a preset ({', '.join(preset_names())}), a checkpoint directory (its family found from "
        "its config.json), or FAMILY:SPEC",
        DATA,
    )
    data: Any = opt(
        "synthetic",
        "synthetic, a dataset directory (format detected), FORMAT:PATH (rlds, lerobot, libero, "
        "parallax) or a mixture FORMAT:A@0.7,FORMAT:B@0.3 (in --config, a [[data]] list)",
        DATA,
        table=True,
    )
    data_config: str | None = opt(
        None,
        "TOML of per-dataset key configs ([name] tables: cameras, state, action keys, "
        "transforms) for datasets the built-in configs do not know",
        DATA,
        metavar="FILE",
    )
    workers: int | None = opt(
        None,
        "processes per rank that decode and augment robot data (0: in the training process)",
        DATA,
        check=at_least(0, " (0: decode in the training process)"),
        default_text="what the host's cores allow, at most 8",
    )
    augment: bool | None = opt(
        None,
        "OpenVLA's training-time image augmentation (random 90% crop, brightness, contrast, "
        "saturation, hue)",
        DATA,
        switch="both",
        default_text="on for robot data, off for the synthetic task",
    )
    freeze: str | None = opt(
        None,
        "GLOB,...: freeze the parameters whose global names match (or a family's alias, such as "
        "'vision'): no gradients, no optimizer state, no reduction",
        DATA,
    )
    freeze_vision: bool = opt(
        False, "freeze the vision tower(s): --freeze vision", DATA, switch="on"
    )
    lr_groups: Any = opt(
        None,
        "GLOB=LR,... or a TOML file of glob = lr (or an [lr_groups] table in --config): peak "
        "learning rates by parameter name; the first match wins, the rest get --lr",
        DATA,
        table=True,
        default_text="the family's (LLaVA-NeXT: the vision tower at lr/10)",
    )
    precision: str = opt(
        "fp32", "bf16: bf16 weights and compute, fp32 masters", DATA, choices=PRECISIONS
    )
    # -- LoRA
    finetune: str = opt(
        "full",
        "full: train every parameter not frozen; lora: low-rank adapters on the frozen base "
        "(lr 5e-4 constant, no warm-up, no clipping unless given)",
        LORA,
        choices=FINETUNES,
    )
    lora_rank: int = opt(32, "adapter rank r", LORA, check=ONE, **LORA_ONLY)
    lora_alpha: float = opt(16.0, "adapter scale alpha / r", LORA, check=positive, **LORA_ONLY)
    lora_dropout: float = opt(
        0.0, "dropout on the adapters' input", LORA, check=within(0, 1, "[)"), **LORA_ONLY
    )
    lora_targets: str = opt(
        "all-linear",
        "'all-linear' (every linear but the output head) or GLOB,... of module names, parallax's "
        "or the HF checkpoint's, whole or as a dotted tail",
        LORA,
        check=_nonempty_globs,
        **LORA_ONLY,
    )
    train: str | None = opt(
        None,
        "GLOB,...: modules (or parameters) trained fully beside the adapters, e.g. "
        "projector,*norm (PEFT's modules_to_save)",
        LORA,
        **LORA_ONLY,
    )
    lora_init: str | None = opt(
        None,
        "DIR: start from this PEFT adapter (adapter_config.json)",
        LORA,
        check=_adapter_dir,
        **LORA_ONLY,
    )
    # -- actions (OpenVLA-OFT)
    action_head: str = opt(
        "tokens",
        "tokens: OpenVLA's discrete action tokens, decoded one by one; l1: OpenVLA-OFT's "
        "parallel decoding (bidirectional attention, empty action slots) with an L1 regression "
        "head on action chunks, the wrist camera and proprio state as the data's key config "
        "gives them",
        ACTIONS,
        choices=ACTION_HEADS,
    )
    action_chunk: int | None = opt(
        None,
        "actions predicted per forward pass (the action dimension comes from the data)",
        ACTIONS,
        check=ONE,
        needs=("action_head", "l1"),
        default_text="8 with --action-head l1 (OFT's LIBERO chunk), else 1",
    )
    film: bool = opt(
        False,
        "FiLM every ViT block of both towers with the mean language embedding (OFT+)",
        ACTIONS,
        switch="on",
        needs=("action_head", "l1"),
    )
    # -- schedule
    steps: int = opt(150, "optimizer steps", SCHEDULE, check=ONE)
    global_batch_size: int = opt(32, "samples per step", SCHEDULE, check=ONE)
    micro_batch_size: int = opt(
        4,
        "samples per microbatch; each dp rank runs global / (micro x dp) microbatches a step",
        SCHEDULE,
        check=ONE,
    )
    schedule: str = opt("1f1b", "pipeline schedule", SCHEDULE, choices=SCHEDULES)
    chunks: int = opt(
        1,
        "model chunks per pipeline rank",
        SCHEDULE,
        check=ONE,
        needs=("schedule", "interleaved"),
    )
    # -- optimisation
    lr: float | None = opt(
        None,
        "peak AdamW learning rate",
        OPTIM,
        check=positive,
        default_text="the model's: tiny 1e-3, small 3e-4, 7B 2e-5; LoRA 5e-4",
    )
    min_lr: float = opt(0.0, "final lr of the cosine schedule", OPTIM, check=at_least(0))
    warmup_steps: int | None = opt(
        None, "linear warm-up steps", OPTIM, check=at_least(0), default_text="20, LoRA 0"
    )
    lr_schedule: str | None = opt(
        None,
        "after the warm-up: constant, cosine to --min-lr, or step (times --lr-decay from each "
        "--lr-decay-steps on: OpenVLA-OFT's MultiStepLR)",
        OPTIM,
        choices=LR_SCHEDULES,
        default_text="cosine, LoRA constant",
    )
    lr_decay_steps: int | None = opt(
        None,
        "with --lr-schedule step: multiply the lr by --lr-decay from this step on (OpenVLA-OFT: "
        "100000 on LIBERO)",
        OPTIM,
        check=ONE,
        needs=("lr_schedule", "step"),
    )
    lr_decay: float = opt(
        0.1,
        "with --lr-schedule step: the factor",
        OPTIM,
        check=within(0, 1, "(]"),
        needs=("lr_schedule", "step"),
    )
    weight_decay: float = opt(
        0.01, "AdamW weight decay, on matrices only", OPTIM, check=at_least(0)
    )
    grad_clip: float | None = opt(
        None,
        "global gradient-norm clip over dp, tp and pp; 0: off (the norm is still logged)",
        OPTIM,
        check=at_least(0),
        default_text="1, LoRA off",
    )
    overlap_grad_reduce: bool = opt(
        True,
        "reduce gradients after the backward instead of during it",
        OPTIM,
        spellings=("--no-overlap",),
        inverted=True,
        default_text="overlapped",
    )
    # -- memory
    zero: int = opt(
        1,
        "ZeRO stage over each dp group: 1 shards the optimizer state and fp32 masters, 2 also "
        "the reduced gradients, 3 also the weights (each block gathered just before its use)",
        MEMORY,
        check=_zero_stage,
        metavar="{1,2,3}",
    )
    reshard_after_forward: bool = opt(
        True,
        "at --zero 3: free each block's gathered weights after its forward and gather them "
        "again for the backward; off: keep them from the first forward to the step (one "
        "gather per block per step, the stage's whole weights held)",
        MEMORY,
        switch="both",
        needs=("zero", 3),
    )
    offload: str = opt(
        "none",
        "optimizer: this rank's fp32 masters and AdamW moments in (pinned) host memory, each "
        "bucket stepped on the host as its gradients arrive (needs --zero 2 or 3)",
        MEMORY,
        choices=OFFLOADS,
    )
    offload_fraction: float = opt(
        1.0,
        "the share of the optimizer state (the last layers' buckets first) on the host",
        MEMORY,
        check=within(0, 1, "(]"),
        needs=("offload", "optimizer"),
        metavar="F",
    )
    gpu_memory_limit: float | None = opt(
        None,
        "cap this process's GPU memory at GIB (torch's per-process memory fraction): emulates "
        "a smaller card on a large one and protects a shared GPU",
        MEMORY,
        check=positive,
        metavar="GIB",
    )
    activation_checkpointing: bool = opt(
        False, "recompute each block's activations in the backward pass", MEMORY, switch="on"
    )
    checkpoint_scope: str = opt(
        "all",
        "which blocks --activation-checkpointing recomputes: all, vision (the towers alone: under "
        "LoRA much of the memory for little of the compute) or text",
        MEMORY,
        choices=CHECKPOINT_SCOPES,
        needs=("activation_checkpointing", True, "it says which blocks recompute"),
    )
    activation_memory_budget: float = opt(
        1.0,
        "the share of a compiled block's saved activations the compiler keeps; below 1 it "
        "recomputes the cheapest of the rest in the backward",
        MEMORY,
        check=within(0, 1, "(]"),
        metavar="FRACTION",
        needs=("compile", True, "it tells the compiler what to recompute"),
    )
    # -- speed
    logits: str = opt(
        "labelled",
        "where the last stage applies the final norm and lm_head: at the labelled positions, "
        "inside the loss, or at every position",
        SPEED,
        choices=LOGITS,
    )
    fused_projections: bool = opt(
        True,
        "q/k/v and gate/up as one weight each (checkpoints keep the separate tensors)",
        SPEED,
        switch="both",
    )
    compile: bool = opt(False, "torch.compile each ViT block and decoder layer", SPEED, switch="on")
    cuda_graphs: bool = opt(
        False,
        "with --compile on GPUs: replay each compiled block as a CUDA graph (reduce-overhead)",
        SPEED,
        switch="on",
        needs=("compile", True, "it replays the compiled blocks"),
    )
    pipeline_syncs: bool = opt(
        False,
        "agree on the pipeline program every step and size received activations from their "
        "metadata (host syncs); default: agree once, sizes from the batch",
        SPEED,
        switch="on",
    )
    overlap_param_gather: bool = opt(
        True,
        "at dp > 1, all-gather the updated weights under the next forward, each block waiting "
        "for its own",
        SPEED,
        switch="both",
    )
    # -- run
    seed: int = opt(0, "seed of the weights (layout-free) and the data order", RUN)
    out: str = opt("runs/parallax", "output directory: metrics.jsonl, checkpoints/, hf/", RUN)
    resume: bool = opt(
        False, "continue from the newest checkpoint in --out, at any layout", RUN, switch="on"
    )
    overwrite: bool = opt(
        False,
        "delete another run's checkpoints and metrics in --out first",
        RUN,
        switch="on",
    )
    save_interval: int = opt(
        100, "checkpoint every N steps and at the end", RUN, check=at_least(0, " (0: never)")
    )
    keep_last: int = opt(2, "checkpoints to keep", RUN, check=ONE)
    log_interval: int = opt(
        10, "print every N steps (metrics.jsonl gets every step)", RUN, check=ONE
    )
    timeout: float = opt(300.0, "seconds a collective may wait", RUN, check=positive)
    export_hf: bool = opt(
        False,
        "also write the final weights in the family's Hugging Face layout to --out/hf",
        RUN,
        switch="on",
    )
    log_to: str | None = opt(
        None,
        "also log every metrics.jsonl and eval.jsonl value (rank 0) to TensorBoard (event files "
        "in --out/tb) and/or Weights & Biases (WANDB_MODE=offline works), comma separated; "
        "optional extras tensorboard, wandb",
        RUN,
        metavar="{tensorboard,wandb}",
    )
    dry_run: bool = opt(
        False, "print the plan (layout, stages, memory, schedule) and exit", RUN, switch="on"
    )
    # -- evaluation
    eval_interval: int = opt(
        0,
        "evaluate on the held-out split every N steps and at the end",
        EVAL,
        check=at_least(0, " (0: never)"),
    )
    eval_batches: int = opt(
        2, "global batches per evaluation, the same ones each time", EVAL, check=ONE
    )
    eval_data: str | None = opt(
        None,
        "the held-out split of a dataset (synthetic tasks use episodes of another seed)",
        EVAL,
    )

    def check(self) -> None:
        """Raise one ``ValueError`` naming every problem no layout could run: the types, each
        option's own checks and the rules between options (the layout is checked later)."""
        problems = config_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def checkpointing(self) -> bool | str:
        """What the models' ``activation_checkpointing`` takes: off, or the scope."""
        if not self.activation_checkpointing:
            return False
        return True if self.checkpoint_scope == "all" else self.checkpoint_scope

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (the config is frozen)."""
        return dataclasses.replace(self, **changes)
