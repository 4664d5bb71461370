"""The one agreement of a training step: every rank's inputs are usable, or every rank raises.

A microbatch count that does not match the schedule, a microbatch without a key the recipe
needs, a problem the recipe sees in a microbatch or one the loader reports: each is found on
one rank alone, so the ranks agree on it in one small all-reduce over the host group before any
other collective of the step, and a problem anywhere raises :class:`InputError` everywhere.
"""

from __future__ import annotations

from parallax import comm
from parallax.recipe import Microbatch


class InputError(ValueError):
    """Some rank's inputs of a step are unusable; ``found`` is every rank's ``"rank R: ..."``
    (the same on every rank)."""

    def __init__(self, found: list[str]) -> None:
        self.found = list(found)
        super().__init__("train_step: " + "; ".join(found))


def check(
    trainer,
    microbatches: list[Microbatch],
    problem: str | None = None,
    wait_s: float = 0.0,
    stop: bool = False,
) -> tuple[float, bool]:
    """Every rank passes ``num_microbatches`` well-formed microbatches (and no ``problem``
    its loader found): the ranks agree on it before any other collective, so a problem on
    one rank raises (:class:`InputError`) on all. Returns the largest ``wait_s`` (this rank's
    wait for its batch) over the ranks and whether any rank asked to ``stop`` (a SIGTERM),
    carried by the same all-reduce."""
    problem = local_problem(trainer, microbatches, problem)
    group = trainer.ctx.agreement_group
    found, (slowest, stopping) = comm.problems_and_max(problem, (wait_s, float(stop)), group)
    if found:
        raise InputError(found)
    return slowest, stopping > 0


def local_problem(
    trainer, microbatches: list[Microbatch], problem: str | None = None
) -> str | None:
    """What is wrong with this rank's microbatches alone (``problem``: the loader's), or
    ``None``: the count, the keys and the recipe's own check. Host work only: the prefetch
    thread also asks it before staging a batch."""
    if problem is None and len(microbatches) != trainer.num_microbatches:
        problem = (
            f"got {len(microbatches)} microbatches, the schedule runs "
            f"{trainer.num_microbatches} (global batch / (micro batch x dp))"
        )
    for m, mb in enumerate(microbatches if problem is None else ()):
        keys = trainer.recipe.data.input_keys
        missing = [k for k in keys if not isinstance(mb, dict) or k not in mb]
        if missing:
            return f"microbatch {m} lacks {', '.join(missing)}"
        problem = trainer.recipe.data.input_problem(trainer.run, mb)
        if problem:
            return f"microbatch {m}: {problem}"
    return problem
