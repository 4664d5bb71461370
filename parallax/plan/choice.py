"""Which of the planner's timed candidates comes first: the fastest, the simpler layout within
a tie of half a percent, and never a choice that more memory makes slower
(:func:`first_choice`); :class:`Candidate` is what the search (:mod:`parallax.plan.search`)
times and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallax.plan.cost import StepTime
from parallax.plan.layout import Layout
from parallax.plan.memory import RankMemory

TIE = 1.005  # step times this close are a tie: the simpler layout goes first


@dataclass(frozen=True)
class Candidate:
    """A layout, its memory per pipeline rank and (once timed) its predicted step."""

    layout: Layout
    memory: tuple[RankMemory, ...]
    gpu: float  # bytes the busiest rank's card needs
    host: float  # bytes one node's host needs
    global_batch: int
    time: StepTime | None = None
    # bytes the layout needs before the GPU's room was filled with gradient sums (the search's
    # ``Searcher._filled``, which grows ``gpu`` to the cap): it fits every cap from here
    least_gpu: float | None = None

    @property
    def fits_from(self) -> float:
        """The least GPU cap this layout (with fewer sums on the GPU where filled) fits."""
        return self.gpu if self.least_gpu is None else self.least_gpu

    @property
    def samples_per_s(self) -> float:
        return 0.0 if self.time is None else self.global_batch / self.time.seconds


def first_choice(timed: list[Candidate]) -> Candidate:
    """The first choice: the fastest of the choices :func:`preference` makes under every
    smaller memory cap. Preferring a simpler layout within a tie could otherwise make more
    memory choose a slower one (up to :data:`TIE`): a simpler layout that only fits the larger
    cap wins the tie against a faster one that fit the smaller cap. Only the fastest's tie
    bucket matters (a choice is in its cap's fastest bucket, never faster than this one), and
    a candidate fits every cap from its GPU need up (the host need does not change with it; a
    layout filled with gradient sums fits from its need without them, with fewer sums and no
    faster: taken at its time here, it is never passed over for a slower simpler one)."""
    bucket = min(preference(c)[0] for c in timed)
    group = sorted((c for c in timed if preference(c)[0] == bucket), key=lambda c: c.fits_from)
    chosen: Candidate | None = None
    for k, c in enumerate(group):
        if k + 1 < len(group) and group[k + 1].fits_from == c.fits_from:
            continue  # the candidates of one need fit together
        under = min(group[: k + 1], key=preference)  # the choice under a cap of c's need
        if chosen is None or under.time.seconds < chosen.time.seconds:
            chosen = under
    assert chosen is not None
    return chosen


def simplicity(lay: Layout) -> tuple:
    """Smaller is simpler: fewer ZeRO stages, no offload, no recomputation, no pipeline."""
    return (lay.zero, lay.offload, bool(lay.checkpointing), lay.pp, lay.tp)


def preference(c: Candidate) -> tuple:
    """Fastest first; within half a percent, the simpler layout (:func:`simplicity`), then
    the one that needs less memory."""
    return (round(math.log(c.time.seconds) / math.log(TIE)), simplicity(c.layout), c.gpu)
