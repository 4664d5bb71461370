"""The learning-rate factor of each step: a pure function of the step and the flags.

The learning rate of step ``s`` is a pure function of ``s`` and the flags (``--lr``,
``--lr-groups``, ``--min-lr``, ``--warmup-steps``, ``--lr-schedule``, ``--steps``; and
``--weight-decay`` beside it). A resumed run therefore follows *its own* flags from the step it
resumes at, as if it had run with them from step 1; the scheduler state in a checkpoint is not
read back, only its step. Flags that differ from the saved run's are named in one line
(:func:`schedule_changes`); raising ``--steps`` past a finished cosine run says that the decay
restarts (from the new cosine's value at that step, not from the finished run's floor), and how
to continue at the floor instead.
"""

from __future__ import annotations

import math
from typing import Any

from parallax.run import TrainConfig
from parallax.run.param_groups import parse_lr_groups


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


SCHEDULE_FLAGS = (
    "lr",
    "lr_groups",
    "min_lr",
    "warmup_steps",
    "lr_schedule",
    "lr_decay_steps",
    "lr_decay",
    "steps",
    "weight_decay",
)


def schedule_changes(saved: dict[str, Any], cfg: TrainConfig, step: int) -> list[str]:
    """What a run resumed at ``step`` does differently from the saved run's flags ``saved``
    (the checkpoint's ``config``): one line naming the changed flags, and a second one when
    ``--steps`` extends a cosine decay that had finished. Empty when nothing changed."""
    changed = []
    for name in SCHEDULE_FLAGS:
        old, new = saved.get(name), getattr(cfg, name)
        if name == "lr_groups":
            old, new = _rates(old), _rates(new)
        if name in saved and old != new:
            changed.append(f"--{name.replace('_', '-')} {_show(old)} -> {_show(new)}")
    if not changed:
        return []
    lr = cfg.lr * lr_lambda(cfg)(step)
    lines = [
        f"--resume at step {step}: the learning-rate schedule follows this run's flags "
        f"({', '.join(changed)}): step {step + 1} trains at lr {lr:.3g}"
    ]
    old_steps, warmup = saved.get("steps"), saved.get("warmup_steps") or 0
    extended = isinstance(old_steps, int) and step >= old_steps and cfg.steps > old_steps
    if extended and saved.get("lr_schedule") == "cosine" and old_steps <= warmup:
        lines.append(
            f"the saved run ended at step {old_steps}, still in its warm-up of {warmup} steps "
            f"(it never decayed): with --steps {cfg.steps} the warm-up goes on to step "
            f"{cfg.warmup_steps}, then the cosine to step {cfg.steps}"
        )
        return lines
    if extended and saved.get("lr_schedule") == "cosine":
        floor = saved.get("min_lr", 0.0)
        instead = (  # a rate must be positive: a floor of 0 has no constant equivalent
            f"To continue at the floor instead, pass --lr-schedule constant --lr {floor:g} "
            "--warmup-steps 0"
            if floor > 0
            else "To continue at a small constant rate instead, pass --lr-schedule constant "
            "--lr RATE --warmup-steps 0 (the floor, 0, would train nothing)"
        )
        lines.append(
            f"the saved run had finished its cosine decay at step {old_steps} (lr {floor:g}); "
            f"with --steps {cfg.steps} the decay restarts from {lr:.3g}. {instead}"
        )
    return lines


def _rates(value) -> Any:
    try:
        return parse_lr_groups(value)
    except ValueError:
        return value


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(f"{g}={lr:g}" for g, lr in value) or "none"
    return str(value)
