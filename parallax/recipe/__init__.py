"""Model families as recipes: what a family tells the one Trainer (:mod:`~parallax.recipe.base`:
a model side, a data side and an objective), the registry that finds a family by ``--model``,
resolving a run for its family (:func:`resolve`), building a chunk as the run adapts it
(:mod:`~parallax.recipe.adapt`) and the command line of every family's options
(:mod:`~parallax.recipe.flags`)."""

from parallax.recipe.base import REQUIRED, Recipe, missing_methods
from parallax.recipe.data_side import DataSide, batch_args
from parallax.recipe.model_side import (
    Microbatch,
    ModelSide,
    ModelSpec,
    init_seed,
    preset_or_checkpoint,
)
from parallax.recipe.objective import (
    MetricSpec,
    NextTokenObjective,
    Objective,
    StepObjective,
    TokenObjective,
)
from parallax.recipe.registry import register
from parallax.recipe.resolve import resolve

__all__ = [
    "REQUIRED",
    "DataSide",
    "MetricSpec",
    "Microbatch",
    "ModelSide",
    "ModelSpec",
    "NextTokenObjective",
    "Objective",
    "Recipe",
    "StepObjective",
    "TokenObjective",
    "batch_args",
    "init_seed",
    "missing_methods",
    "preset_or_checkpoint",
    "register",
    "resolve",
]
