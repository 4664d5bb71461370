"""Model families as recipes: everything the one Trainer needs to know about a model.

The Trainer, the CLI, ``--dry-run``, checkpoints, the planner and the benchmarks own what every
family shares (the layout, the pipeline schedule, ZeRO, parameter groups and freezing, the
learning-rate schedule, checkpoints, metrics and the step loop). A :class:`Recipe` tells them
the rest through three parts, each in its own module with its defaults:

- **the model** (:class:`~parallax.recipe.model_side.ModelSide`): ``resolve`` (a preset or
  checkpoint -> config), ``blocks`` (the ordered pipeline blocks with their costs) and
  ``build`` (this rank's chunk of a block range, from the layout-free init or a checkpoint,
  each rank reading only its slice);
- **the data** (:class:`~parallax.recipe.data_side.DataSide`): ``dataset`` (what ``--data``
  names), ``collator`` (raw samples -> a microbatch dict of host tensors), ``stage_inputs``
  (what the first stage takes) and ``stage_metas`` (what later stages receive);
- **the objective** (:mod:`parallax.recipe.objective`): ``loss_units``, ``loss_target`` and
  ``loss`` of a ``"tokens"`` objective, or ``forward_backward`` of a ``"step"`` one.

That is ten methods for a family whose loss runs per microbatch (:data:`REQUIRED`); every other
hook has a default. A family may declare its own options (``options``: a dataclass of
``opt()`` fields, shown by ``--help`` under the family's group) and may answer a run with a
variant of itself (:meth:`Recipe.variant`: OpenVLA with ``--action-head l1`` is OpenVLA-OFT).
Recipes are registered by name (:func:`parallax.register`, :mod:`parallax.recipe.registry`);
nothing in ``parallax.train`` names a family. ``examples/custom_recipe.py`` is the minimum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parallax.recipe.data_side import DataSide
from parallax.recipe.model_side import ModelSide
from parallax.recipe.objective import Objective, StepObjective, TokenObjective

# what a family must define, by part (and for the objective, by its kind)
REQUIRED = {
    "model": ("resolve", "blocks", "build"),
    "data": ("dataset", "collator"),
    "tokens": ("stage_inputs", "stage_metas", "loss_units", "loss_target", "loss"),
    "step": ("forward_backward",),
}


class Recipe:
    """A model family: its name, its own options and its three parts (see the module doc)."""

    name: str = ""  # the family, as --model FAMILY:SPEC and checkpoints name it
    options: type | None = None  # the family's own options: a dataclass of opt() fields
    # core options this family does not read: refused when given, never silently ignored
    unread: tuple[str, ...] = ()

    def __init__(self, model: ModelSide, data: DataSide, objective: Objective) -> None:
        self.model, self.data, self.objective = model, data, objective

    def presets(self) -> Sequence[str]:
        """Preset names ``--model`` accepts (the model side's)."""
        return self.model.presets()

    def variant(self, options: Any, config: Any) -> Recipe:
        """The recipe that runs a model of ``config`` with the family's ``options`` (their
        dataclass, or None): this one, unless the options change the data and the objective."""
        return self


def missing_methods(recipe: Recipe) -> list[str]:
    """The methods ``recipe`` must define for its objective and does not (``part.method``)."""
    kind = getattr(recipe.objective, "kind", None)
    if kind not in ("tokens", "step"):
        return [f"objective kind {kind!r} (a TokenObjective or a StepObjective)"]
    wanted = [("model", n) for n in REQUIRED["model"]] + [("data", n) for n in REQUIRED["data"]]
    wanted += [("data" if n.startswith("stage_") else "objective", n) for n in REQUIRED[kind]]
    parts = {"model": recipe.model, "data": recipe.data, "objective": recipe.objective}
    return [f"{part}.{n}" for part, n in wanted if _inherited(type(parts[part]), n)]


def _inherited(cls: type, name: str) -> bool:
    """Whether ``cls`` has ``name`` only as one of the library's base parts declares it."""
    mine = getattr(cls, name, None)
    bases = (ModelSide, DataSide, Objective, TokenObjective, StepObjective)
    return mine is None or any(mine is getattr(b, name, object()) for b in bases)
