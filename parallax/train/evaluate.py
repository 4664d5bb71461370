"""Evaluation while training: every ``--eval-interval`` steps, the loss and the recipe's metrics
on a held-out split, forward only, written to ``eval.jsonl`` and printed.

The split is the recipe's (``Recipe.eval_dataset``: for the synthetic tasks, episodes of another
seed; for a dataset directory, ``--eval-data DIR``). Each evaluation reads the same first
``--eval-batches`` global batches of it in a fixed order, so the numbers are comparable from one
evaluation to the next and the same at every layout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from parallax import comm
from parallax.data import BatchLoader
from parallax.recipe import batch_args
from parallax.recipe.objective import metric_values
from parallax.train.batch_checks import InputError

log = logging.getLogger("parallax.train")


class EvalDataError(ValueError):
    """The held-out split gave some rank an unusable batch (the same message on every rank)."""

    def __init__(self, step: int, batch: int, found: list[str]) -> None:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        super().__init__(f"the evaluation at step {step}, batch {batch}: {found[0]}{more}")


class Evaluator:
    """Runs the evaluation of one run (collective: every rank calls :meth:`maybe_run`)."""

    def __init__(self, trainer, dataset, collate, out: Path) -> None:
        self.trainer, self.dataset, self.collate = trainer, dataset, collate
        self.path = out / "eval.jsonl"
        run, ctx = trainer.run, trainer.ctx
        self.every, self.batches = run.eval_interval, run.eval_batches
        BatchLoader(  # the batch sizes and the split's size, checked before the first step
            dataset,
            **batch_args(run, ctx),
        )

    def maybe_run(self, step: int, last: bool = False) -> dict[str, float] | None:
        if not self.every or (step % self.every and not last):
            return None
        return self.run(step)

    def run(self, step: int) -> dict[str, float]:
        trainer, run, ctx = self.trainer, self.trainer.run, self.trainer.ctx
        loader = BatchLoader(
            self.dataset,
            **batch_args(run, ctx),
        )
        sums, units = None, 0
        for i in range(min(self.batches, loader.steps_per_epoch)):
            try:  # bad data on one rank: every rank stops here, before the forward's collectives
                mbs, problem = [self.collate(samples) for samples in loader.next_batch()], None
            except (ValueError, FileNotFoundError) as err:  # DatasetError is a ValueError
                mbs, problem = [], str(err)
            try:
                got = trainer.eval_step(mbs, problem=problem)
            except InputError as err:
                raise EvalDataError(step, i, err.found) from None
            sums = got if sums is None else sums + got
            units += sum(int(trainer.recipe.objective.loss_units(mb)) for mb in mbs)
        total = torch.tensor(float(units), device=ctx.device)
        comm.all_reduce(total, ctx.dp_group)
        values = sums.tolist()
        row = {"step": step, "eval_loss": values[0] / max(float(total), 1.0)}
        metrics = metric_values(trainer.recipe.objective, values, evaluation=True)
        row.update({f"eval_{k}": v for k, v in metrics.items()})
        if ctx.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            text = "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "step")
            log.info("eval at step %d: %s", step, text)
        return row
