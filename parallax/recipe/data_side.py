"""A recipe's data side: what ``--data`` opens, how samples become microbatches and what the
pipeline's stages take.

A family writes ``dataset`` and ``collator`` (and, for a ``"tokens"`` objective, which runs a
pipeline, ``stage_inputs`` and ``stage_metas``) and overrides what differs from the defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallax.context import ParallelContext
from parallax.data import BatchLoader
from parallax.pipeline import TensorMeta
from parallax.recipe.model_side import Microbatch
from parallax.run import Run


def batch_args(run: Run, ctx: ParallelContext) -> dict[str, int]:
    """The batch sizes, this rank's dp share and the seed: what every loader of a run takes."""
    return dict(
        global_batch_size=run.global_batch_size,
        micro_batch_size=run.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        seed=run.seed,
    )


class DataSide:
    """The data of a family; see the module docstring."""

    # keys every microbatch dict must hold (checked on every rank before a step)
    input_keys: tuple[str, ...] = ()
    # whether the collator rounds its text up to ``--pad-to-multiple-of`` (refused elsewhere)
    pads_text: bool = False

    # -- what a family must say ------------------------------------------------------------------
    def dataset(self, spec: Any, run: Run) -> Any:
        """The dataset ``--data spec`` names (random access: ``len`` and ``[i]``)."""
        raise NotImplementedError

    def collator(self, run: Run, dataset: Any) -> Callable[[Sequence[Any]], Microbatch]:
        """A function from a list of raw samples to one microbatch of host tensors."""
        raise NotImplementedError

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        """What the first stage's forward takes, in order (a ``"tokens"`` objective)."""
        raise NotImplementedError

    def stage_metas(self, run: Run, mb: Microbatch, dtype: torch.dtype) -> list[TensorMeta]:
        """What every later stage receives for this microbatch (read from host shapes, the same
        on every rank, so the pipeline needs no metadata round trip)."""
        raise NotImplementedError

    # -- optional ----------------------------------------------------------------------------------
    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        """The held-out split for ``--eval-interval``: ``--eval-data spec``, or with ``None`` the
        family's own held-out part of ``run.data`` (a ``ValueError`` when it has none)."""
        if spec is None:
            raise ValueError("--eval-interval: give the held-out data with --eval-data")
        return self.dataset(spec, run)

    def loader(self, dataset: Any, run: Run, ctx: ParallelContext) -> Any:
        """What yields this dp rank's raw samples per step: ``next_batch()`` -> a list of
        ``num_microbatches`` lists of samples, and a JSON ``state_dict()`` /
        ``load_state_dict()`` (saved in checkpoints; a resume at any layout continues it).
        The sample order of each global batch must depend on ``run.seed`` and the position
        only, never on dp. Default: the random-access :class:`~parallax.data.BatchLoader`;
        a family whose data streams returns its own (``close()`` is called at the end)."""
        return BatchLoader(dataset, **batch_args(run, ctx))

    def input_problem(self, run: Run, mb: Microbatch) -> str | None:
        """What is wrong with one microbatch (shapes, sizes), or ``None``: checked on every rank
        before a training step's first collective, so a bad one raises on all ranks."""
        return None
