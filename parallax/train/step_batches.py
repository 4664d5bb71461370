"""The batches of a session's steps, made ``--prefetch`` steps ahead of the step that uses them.

Every family's batches pass here: the loader's raw samples of the next step, the recipe's
collator (tokenising, padding), the local checks of :mod:`parallax.train.batch_checks`, then
this rank's device inputs (:mod:`parallax.train.staging`: pinned and copied on a side CUDA
stream). With ``--prefetch N`` (default 1) a background thread does all of it for the next N
steps while the current one runs (:class:`~parallax.data.prefetch.Prefetcher`); with 0 the
training thread does it between steps, as it always did. Either way the loader is asked in the
same order, from one thread, so the batches are the same.

The loader runs ahead of the steps, so a checkpoint must not save its live position:
:meth:`StepBatches.state_dict` is the position after the last batch the steps *took*, copied
when the batch was made. ``data_wait_s`` is the time :meth:`StepBatches.next` blocked.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from parallax.data.prefetch import Prefetcher
from parallax.recipe import Microbatch
from parallax.train.agreement import USER_ERRORS
from parallax.train.batch_checks import local_problem
from parallax.train.staging import Staged


@dataclass
class StepBatch:
    """One step's batch on this rank."""

    microbatches: list[Microbatch]  # host tensors, as the collator made them
    problem: str | None  # this rank's data could not make the batch (every rank agrees on it)
    state: dict[str, Any]  # the loader's position after this batch (what a checkpoint saves)
    staged: Staged | None = None  # the device inputs, made ahead (None: the step copies them)
    waited_s: float = 0.0  # how long the step waited for it


class StepBatches:
    """The batches of steps ``start + 1 .. steps`` (see the module doc)."""

    def __init__(self, loader, builder, trainer, start: int, steps: int, depth: int = 1) -> None:
        self.loader, self.builder, self.trainer = loader, builder, trainer
        self.depth = depth
        self._state = copy.deepcopy(loader.state_dict())  # before the thread touches it
        self._prefetcher = Prefetcher(
            self._make,
            max(steps - start, 0),
            depth,
            describe=lambda i: f"the batch of step {start + 1 + i}",
            name="parallax-batches",
        )

    def _make(self, index: int) -> StepBatch:
        microbatches, problem = next_microbatches(self.loader, self.builder)
        state = copy.deepcopy(self.loader.state_dict())
        staged = None
        if self.depth > 0:
            problem = local_problem(self.trainer, microbatches, problem)
            if problem is None:  # a bad batch is refused by the step, on every rank
                staged = self.trainer.stager(microbatches, ahead=True)
        return StepBatch(microbatches, problem, state, staged)

    def next(self) -> StepBatch:
        """The next step's batch, with how long this call waited for it."""
        began = time.perf_counter()
        batch = self._prefetcher.get()
        batch.waited_s = time.perf_counter() - began
        self._state = batch.state
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The loader's position after the last batch taken (what a resume continues from)."""
        return self._state

    def close(self) -> None:
        """Stop the thread (between batches), then the loader's worker processes."""
        try:
            self._prefetcher.close()
        finally:
            if hasattr(self.loader, "close"):
                self.loader.close()


def next_microbatches(loader, builder) -> tuple[list, str | None]:
    """This rank's microbatches of the next step, or ``([], message)`` when its data is bad
    (the trainer then makes every rank agree on it before the step runs)."""
    try:
        return [builder(samples) for samples in loader.next_batch()], None
    except USER_ERRORS as err:
        return [], str(err)
