"""Training options: one frozen dataclass, each field declared once with :func:`opt`.

A field's declaration is its flag (``--global-batch-size``), its TOML key (``global_batch_size``
or ``global-batch-size`` in a ``--config`` file; flags given on the command line win), its
default, help text, ``--help`` group and checks (:mod:`parallax.run.option`). Cross-option rules
are :data:`~parallax.run.rules.RULES`. Defaults do not depend on the layout, so the same command
trains the same model at every ``dp x tp x pp``. ``None`` means "the family decides" (the
learning rate, its schedule, the lr groups): :func:`parallax.recipe.resolve` fills those in,
once, into the frozen :class:`~parallax.run.Run` the rest of a run reads.

The core declarations live by meaning in ``parallax/run/options_*.py``, one base class per
``--help`` group; :class:`TrainConfig` gathers them, in the order ``--help`` shows them. A
family's own options (OpenVLA-OFT's action head, say) are declared in its package; their values
ride along in ``family_values`` until the run is resolved for that family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from parallax.data import check_batch_sizes
from parallax.optim.zero.stage import host_adamw_kernel
from parallax.run.options_layout import (
    INTERCONNECTS,
    LAYOUTS,
    SCHEDULES,
    LayoutOptions,
    ScheduleOptions,
)
from parallax.run.options_memory import (
    LOGITS,
    OFFLOADS,
    ZERO_STAGES,
    MemoryOptions,
    SpeedOptions,
)
from parallax.run.options_model import FINETUNES, PRECISIONS, DataOptions, LoraOptions
from parallax.run.options_optim import LR_SCHEDULES, OptimOptions
from parallax.run.options_run import ConfigFileOption, EvalOptions, RunOptions
from parallax.run.rules import config_problems

# what ``None`` means for the optimisation flags: full fine-tuning's defaults, and OpenVLA's LoRA
# recipe (5e-4 constant, no warm-up, no clipping; ``lr`` from the recipe's default_lr)
FULL_DEFAULTS = {"warmup_steps": 20, "lr_schedule": "cosine", "grad_clip": 1.0}
LORA_DEFAULTS = {"warmup_steps": 0, "lr_schedule": "constant", "grad_clip": 0.0}

__all__ = [
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
    LoraOptions,
    DataOptions,
    LayoutOptions,
    ConfigFileOption,
):
    """Everything a training run is told; saved into every checkpoint (``to_dict``)."""

    # the family's own options given (flag name -> value), checked against the family's
    # declarations when the run is resolved for it
    family_values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """A config of option values by name, a family's among them (what flags and TOML keys
        give; those that are not core options ride in ``family_values`` and are checked
        against the family's declarations when the run is resolved)."""
        core = {f.name for f in dataclasses.fields(cls)}
        family = dict(values.pop("family_values", {}))
        family.update({k: values.pop(k) for k in list(values) if k not in core})
        return cls(**values, family_values=family)

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

    def host_kernel(self, device_type: str = "cuda") -> str:
        """The host AdamW an offloaded bucket steps with on a ``device_type`` run: torch's where
        unclipped (each bucket steps in the backward), else ``--host-adamw`` (``auto``: one
        pass on GPUs, torch's kernel on the CPU)."""
        return host_adamw_kernel(self.host_adamw, device_type) if self.grad_clip else "torch"

    def host_masters_kind(self, device_type: str = "cuda") -> str:
        """Where this run on a ``device_type`` keeps its offloaded bf16 masters on the host:
        split where ``--host-masters split`` asks and the one-pass AdamW steps them (the rules
        refuse what they can tell apart, e.g. an unclipped run; a CPU run's default torch
        kernel keeps them whole, and the trainer says so)."""
        stepped = self.offload == "optimizer" and self.host_kernel(device_type) == "one-pass"
        return "split" if stepped and self.host_masters == "split" else "full"

    @property
    def host_masters_split(self) -> bool:
        """Whether a run on GPUs (what the planner plans), where it offloads, keeps its bf16
        masters split on the host."""
        split = self.host_masters == "split" and self.precision == "bf16"
        return split and self.host_step_one_pass

    @property
    def host_step_one_pass(self) -> bool:
        """Whether offloaded buckets of a run on GPUs (what the planner plans) step in one pass
        on the host."""
        return self.host_kernel("cuda") == "one-pass"

    def num_microbatches(self, dp: int) -> int:
        """Microbatches each dp rank runs per step (the pipeline's m); checks the batch sizes."""
        check_batch_sizes(self.global_batch_size, self.micro_batch_size, dp)
        return self.global_batch_size // (self.micro_batch_size * dp)

    def core_options(self) -> dict[str, Any]:
        """The core options by name (what ``TrainConfig(**...)`` takes back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}

    def to_dict(self) -> dict[str, Any]:
        """Every option by name, the family's among them (as checkpoints save them)."""
        out = self.core_options()
        return {**{k: v for k, v in out.items() if k != "family_values"}, **self.family_values}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (the config is frozen)."""
        return dataclasses.replace(self, **changes)
