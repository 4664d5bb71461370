"""Training entry point: ``torchrun --nproc-per-node N -m parallax.train --tp T --pp P``.

:func:`main` is the command; :class:`~parallax.train.trainer.Trainer` is the composition (one
model of any registered family split over pp, sharded over tp, ZeRO-1 over dp) for scripts
that drive steps themselves.
"""

from parallax.train.cli import main, run
from parallax.train.config import TrainConfig, parse_args
from parallax.train.trainer import StepOutput, Trainer

__all__ = ["StepOutput", "TrainConfig", "Trainer", "main", "parse_args", "run"]
