"""Training options: one frozen dataclass, each field declared once with :func:`opt`.

A field's declaration is its flag (``--global-batch-size``), its TOML key (``global_batch_size``
or ``global-batch-size`` in a ``--config`` file; flags given on the command line win), its
default, help text, ``--help`` group and checks (:mod:`parallax.train.options`). Cross-option
rules are :data:`RULES` in :mod:`parallax.train.rules`. Defaults do not depend on the layout, so
the same command trains the same model at every ``dp x tp x pp``. ``None`` means "the family
decides" (the learning rate, its schedule, the lr groups): :func:`parallax.train.run.resolve`
fills those in, once, into the frozen :class:`~parallax.train.run.Run` the rest of a run reads.

The declarations live by meaning in ``parallax/train/options_*.py``, one base class per
``--help`` group; :class:`TrainConfig` gathers them, in the order ``--help`` shows them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from parallax.train.options_layout import (
    INTERCONNECTS,
    LAYOUTS,
    SCHEDULES,
    LayoutOptions,
    ScheduleOptions,
)
from parallax.train.options_memory import (
    LOGITS,
    OFFLOADS,
    ZERO_STAGES,
    MemoryOptions,
    SpeedOptions,
)
from parallax.train.options_model import (
    ACTION_HEADS,
    FINETUNES,
    PRECISIONS,
    ActionOptions,
    DataOptions,
    LoraOptions,
)
from parallax.train.options_optim import LR_SCHEDULES, OptimOptions
from parallax.train.options_run import ConfigFileOption, EvalOptions, RunOptions
from parallax.train.rules import config_problems

# what ``None`` means for the optimisation flags: full fine-tuning's defaults, and OpenVLA's LoRA
# recipe (5e-4 constant, no warm-up, no clipping; ``lr`` from the recipe, Recipe.default_lr)
FULL_DEFAULTS = {"warmup_steps": 20, "lr_schedule": "cosine", "grad_clip": 1.0}
LORA_DEFAULTS = {"warmup_steps": 0, "lr_schedule": "constant", "grad_clip": 0.0}

__all__ = [
    "ACTION_HEADS",
    "FINETUNES",
    "FULL_DEFAULTS",
    "INTERCONNECTS",
    "LAYOUTS",
    "LOGITS",
    "LORA_DEFAULTS",
    "LR_SCHEDULES",
    "OFFLOADS",
    "PRECISIONS",
    "SCHEDULES",
    "ZERO_STAGES",
    "TrainConfig",
]


# a dataclass takes its fields from its last base first, so the groups are listed last-first:
# the fields (and ``to_dict``, ``--help`` and the reference) run from --config and the layout
# down to evaluation
@dataclass(frozen=True)
class TrainConfig(
    EvalOptions,
    RunOptions,
    SpeedOptions,
    MemoryOptions,
    OptimOptions,
    ScheduleOptions,
    ActionOptions,
    LoraOptions,
    DataOptions,
    LayoutOptions,
    ConfigFileOption,
):
    """Everything a training run is told; saved into every checkpoint (``to_dict``)."""

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
