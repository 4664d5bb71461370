"""Training entry point: ``torchrun --nproc-per-node N -m parallax.train --tp T --pp P``.

:func:`main` is the command. For scripts that drive steps themselves: :func:`parse_args` (the
options, a :class:`~parallax.run.TrainConfig`), :func:`parallax.recipe.resolve` (the resolved
:class:`~parallax.run.Run`; :func:`resolve_run` adds ``--layout auto``'s layout) and
:class:`~parallax.train.trainer.Trainer` (one model of any registered family split over pp,
sharded over tp, ZeRO over dp).
"""

from parallax.recipe import resolve
from parallax.recipe.flags import parse_args
from parallax.run import Run, TrainConfig
from parallax.train.cli import main, resolve_run, run
from parallax.train.trainer import StepOutput, Trainer

__all__ = [
    "Run",
    "StepOutput",
    "TrainConfig",
    "Trainer",
    "main",
    "parse_args",
    "resolve",
    "resolve_run",
    "run",
]
