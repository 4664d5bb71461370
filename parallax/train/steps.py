"""How many microbatches a step runs, which schedule runs them, and the learning-rate factor of
each step: pure functions of the flags, shared by the Trainer and ``--dry-run``."""

from __future__ import annotations

import math

from parallax.pipeline import Schedule, gpipe, interleaved_1f1b, one_f_one_b
from parallax.train.config import TrainConfig


def make_schedule(name: str, pp: int, num_microbatches: int, chunks: int) -> Schedule:
    """The schedule named by ``--schedule``; raises ``ValueError`` saying what would work."""
    if name == "gpipe":
        return gpipe(pp, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, num_microbatches)
    if name == "interleaved":
        return interleaved_1f1b(pp, num_microbatches, chunks)
    raise ValueError(f"unknown schedule {name!r}: use gpipe, 1f1b or interleaved")


def num_microbatches(cfg: TrainConfig, dp: int) -> int:
    """Microbatches each dp rank runs per step (the pipeline's m); checks the batch sizes."""
    from parallax.data import check_batch_sizes

    check_batch_sizes(cfg.global_batch_size, cfg.micro_batch_size, dp)
    return cfg.global_batch_size // (cfg.micro_batch_size * dp)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to the peak, then constant, cosine down to ``min_lr / lr`` of it at
    ``steps``, or ``step``: the peak until step ``lr_decay_steps``, ``lr_decay`` times it from
    there on (OpenVLA-OFT's ``MultiStepLR(milestones=[N], gamma=0.1)``: the step with 0-based
    index N is the first at the lower rate). A factor on every group's own peak rate."""
    if cfg.lr_schedule == "step" and not (cfg.lr_decay_steps or 0) >= 1:
        raise ValueError(
            f"--lr-schedule step needs --lr-decay-steps N >= 1, got {cfg.lr_decay_steps}"
        )

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        if cfg.lr_schedule == "step":
            return cfg.lr_decay if step >= cfg.lr_decay_steps else 1.0
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
