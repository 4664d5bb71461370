"""The ``TrainConfig`` options of the optimiser: AdamW, its learning-rate schedule, clipping and
when gradients are reduced; :mod:`parallax.run.config` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.run.option import ONE, at_least, opt, positive, within

LR_SCHEDULES = ("constant", "cosine", "step")
OPTIM = "optimisation"


@dataclass(frozen=True)
class OptimOptions:
    """The ``optimisation`` group; ``None`` means the family's or LoRA's default."""

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
