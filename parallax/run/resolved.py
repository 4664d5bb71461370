"""One training run, resolved once: the options with every family default filled in, the
family's recipe and own options, and the model.

:func:`parallax.recipe.resolve` makes it from a :class:`~parallax.run.TrainConfig` (checked
there, once): it finds the family, resolves ``--model`` to its config and checkpoint, fills in
what the family decides (the learning rate, its schedule and groups, LoRA's recipe), reads the
family's own options and applies the run's options to the model config. The CLI does this once
and passes the Run down to the Trainer, the recipe, checkpoints, ``--dry-run`` and the planner;
nothing edits it later (``--layout auto`` makes a new one with the layout filled in).

A Run *is* the config it was resolved from (a subclass: ``run.lr``, ``run.seed``), with what
resolving found beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from parallax.run.config import TrainConfig


class Family(Protocol):
    """What a run holds of its family: a :class:`parallax.recipe.Recipe` (named here by what it
    has, since the recipe layer sits above this one)."""

    name: str
    options: type | None
    model: Any  # a parallax.recipe.ModelSide
    data: Any  # a parallax.recipe.DataSide
    objective: Any  # a parallax.recipe.Objective


@dataclass(frozen=True, kw_only=True)
class Run(TrainConfig):
    """The resolved run: the options (every family default filled in), the family's recipe and
    its own options, the model's config (after the run's options) and the checkpoint it starts
    from."""

    recipe: Family
    model_name: str  # --model without its FAMILY: prefix
    model_config: Any
    checkpoint: Path | None = None
    # the family's own options (its declared dataclass, defaults filled in), or None
    family_options: Any = None

    @property
    def family(self) -> str:
        return self.recipe.name

    def to_dict(self) -> dict[str, Any]:
        """Every option, the family's with its defaults (as checkpoints save them)."""
        own = {} if self.family_options is None else dataclasses.asdict(self.family_options)
        return {**super().to_dict(), **own}

    def replace(self, **changes: Any) -> Run:
        """A copy with other option values (the model stays as resolved; the run is frozen)."""
        return dataclasses.replace(self, **changes)
