"""The recipe protocol and the registry: what a model family tells the one Trainer, and how a
``--model`` finds its family (see :mod:`parallax.recipe.protocol`)."""

from parallax.recipe.protocol import (
    REQUIRED,
    MetricSpec,
    Microbatch,
    ModelSpec,
    Recipe,
    batch_args,
    missing_methods,
)
from parallax.recipe.registry import register

__all__ = [
    "REQUIRED",
    "MetricSpec",
    "Microbatch",
    "ModelSpec",
    "Recipe",
    "batch_args",
    "missing_methods",
    "register",
]
