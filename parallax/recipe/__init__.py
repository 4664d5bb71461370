"""The recipe protocol and the registry: what a model family tells the one Trainer, and how a
``--model`` finds its family (see :mod:`parallax.recipe.protocol`)."""

from parallax.recipe.protocol import MetricSpec, Microbatch, ModelSpec, Recipe
from parallax.recipe.registry import register

__all__ = ["MetricSpec", "Microbatch", "ModelSpec", "Recipe", "register"]
