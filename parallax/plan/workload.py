"""A run's workload as the planner needs it, whatever the layout: the model's blocks and their
costs, what one sample keeps and computes in each (:meth:`ModelSide.block_estimates`), the
parameters of each block at a tp (:mod:`parallax.plan.blocks`), the pipeline splits and the
schedules' in-flight microbatches. Everything is computed once and cached, so a search over
thousands of layouts is arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from parallax.models.estimate import BlockEstimate
from parallax.pipeline import make_schedule, split
from parallax.plan.blocks import BlockParams, block_params
from parallax.plan.layout import Layout
from parallax.run import Run


class Workload:
    """See the module docstring; ``run`` is a resolved :class:`~parallax.run.Run`."""

    def __init__(self, run: Run, blocks=None, estimates=None, params=None) -> None:
        """``blocks``, ``estimates`` and ``params`` (a function of tp) stand in for the
        recipe's (a model described by its numbers alone, as the tests do)."""
        self.run, self.recipe, self.config = run, run.recipe, run.model_config
        self.blocks = blocks if blocks is not None else self.recipe.model.blocks(self.config)
        if estimates is None:
            estimates = self.recipe.model.block_estimates(run)
        self.estimates: list[BlockEstimate] = list(estimates)
        if len(self.estimates) != len(self.blocks):
            raise ValueError(
                f"the {self.recipe.name} recipe estimates {len(self.estimates)} blocks of its "
                f"{len(self.blocks)}"
            )
        self.e = 2 if run.precision == "bf16" else 4  # bytes per element of the model's dtype
        # GradCache: one microbatch held
        self.step_objective = self.recipe.objective.kind == "step"
        self._count = params or (lambda tp: block_params(run, tp))
        self._ranges: dict[tuple[int, int], list[range]] = {}
        self._states: dict[tuple, tuple] = {}
        self._params: dict[int, tuple[BlockParams, ...]] = {}
        self.cache: dict[tuple, object] = {}  # the memory model's per-shape sums

    @property
    def global_batch(self) -> int:
        return self.run.global_batch_size

    def params(self, tp: int) -> tuple[BlockParams, ...]:
        if tp not in self._params:
            self._params[tp] = tuple(self._count(tp))
        return self._params[tp]

    @cached_property
    def total_params(self) -> int:
        return sum(b.params for b in self.params(1))

    def ranges(self, pp: int, chunks: int) -> list[range]:
        """The blocks of each virtual stage (``ValueError`` when they cannot fill them)."""
        key = (pp, chunks)
        if key not in self._ranges:
            costs = [b.cost for b in self.blocks]
            pin = self.recipe.model.pin_first
            self._ranges[key] = split(costs, pp, chunks, pin_first=pin)
        return self._ranges[key]

    def stages_of(self, layout: Layout, pp_rank: int) -> list[int]:
        """The virtual stages pipeline rank ``pp_rank`` holds (stage ``s`` on ``s % pp``)."""
        n = layout.pp * layout.chunks
        return [s for s in range(n) if s % layout.pp == pp_rank]

    def microbatches(self, layout: Layout) -> int:
        return self.global_batch // (layout.micro_batch_size * layout.dp)

    def in_flight_states(self, layout: Layout, pp_rank: int) -> tuple[tuple[int, ...], ...]:
        """The distinct counts of microbatches held per local stage (forwards whose backward
        has not run) over the schedule of ``pp_rank``: the activation peak is the largest of
        these weighted by each stage's bytes."""
        m = self.microbatches(layout)
        if self.step_objective or layout.pp == 1:
            return ((1,),)
        if layout.schedule == "1f1b":  # p - rank warm-up forwards, then one in, one out
            return ((min(layout.pp - pp_rank, m),),)
        if layout.schedule == "gpipe":
            return ((m,),)
        # an interleaved schedule's first 2p microbatches hold its peak whatever comes after
        m = min(m, 2 * layout.pp)
        key = (layout.schedule, layout.pp, m, layout.chunks)
        if key not in self._states:
            schedule = make_schedule(layout.schedule, layout.pp, m, layout.chunks)
            self._states[key] = tuple(
                _held_states(schedule.actions[r], self.stages_of(layout, r))
                for r in range(layout.pp)
            )
        return self._states[key][pp_rank]


def _held_states(actions, local: list[int]) -> tuple[tuple[int, ...], ...]:
    held = dict.fromkeys(local, 0)
    states = set()
    for a in actions:
        if a.kind in ("F", "B"):
            held[a.stage] += 1 if a.kind == "F" else -1
            states.add(tuple(held[s] for s in local))
    return tuple(_maximal(states))


def _maximal(states: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The states no other state holds as much of in every stage, or more."""
    ordered = sorted(states, key=sum, reverse=True)
    out: list[tuple[int, ...]] = []
    for s in ordered:
        if not any(all(a >= b for a, b in zip(t, s)) for t in out):
            out.append(s)
    return out


def peak_weighted(states: Sequence[tuple[int, ...]], weights: Sequence[float]) -> float:
    """The largest of ``states`` weighted by ``weights``."""
    return max(sum(c * w for c, w in zip(s, weights)) for s in states)
