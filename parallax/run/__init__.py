"""The run's vocabulary, below everything that reads it: the option declarations
(:mod:`~parallax.run.option`), their values from flags and TOML files
(:mod:`~parallax.run.command_line`, :mod:`~parallax.run.values`), the rules between options
(:mod:`~parallax.run.rules`), :class:`TrainConfig` (what a run is told) and :class:`Run` (the
run resolved for its family, :func:`parallax.recipe.resolve`), and the parameter groups the
options name (:mod:`~parallax.run.param_groups`)."""

from parallax.run.config import FULL_DEFAULTS, LORA_DEFAULTS, TrainConfig
from parallax.run.option import opt
from parallax.run.resolved import Run

__all__ = ["FULL_DEFAULTS", "LORA_DEFAULTS", "Run", "TrainConfig", "opt"]
