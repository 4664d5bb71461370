"""Training entry point: ``torchrun --nproc-per-node N -m parallax.train --tp T --pp P``.

:func:`main` is the command. For scripts that drive steps themselves: :func:`parse_args` (the
options, :class:`TrainConfig`), :func:`resolve` (the resolved :class:`Run`) and
:class:`~parallax.train.trainer.Trainer` (one model of any registered family split over pp,
sharded over tp, ZeRO over dp).
"""

from parallax.train.args import parse_args
from parallax.train.cli import main, run
from parallax.train.config import TrainConfig
from parallax.train.run import Run, resolve
from parallax.train.trainer import StepOutput, Trainer

__all__ = [
    "Run",
    "StepOutput",
    "TrainConfig",
    "Trainer",
    "main",
    "parse_args",
    "resolve",
    "run",
]
