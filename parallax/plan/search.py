"""The search: every layout that multiplies to the world, the ones that fit, the fastest first.

Candidates: tp within a node (dividing the heads: the family's ``check_layout``), pp splitting
the blocks, dp the rest, then the ZeRO stage, offload and (ZeRO-3) resharding, activation
checkpointing and its scope, the micro-batch (dividing the per-rank batch), and for pp > 1 the
schedule (1F1B, interleaved with two chunks, GPipe where 1F1B cannot fill the pipeline). Options
in ``fixed`` (the flags a user gave) are not searched. A candidate fits when its busiest rank's
GPU need (the allocator's reserve and the CUDA context included) and its node's host need are
within the machine's memory less ``margin``; the options' own rules are checked as a run checks
them (``TrainConfig.check``). Memory is arithmetic; the pipeline simulation runs only for the
candidates whose time could still be among the best.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Any

from parallax.dims import ParallelDims
from parallax.plan.choice import TIE, Candidate, first_choice, preference
from parallax.plan.cost import step_time
from parallax.plan.layout import OPTION_NAMES, Layout
from parallax.plan.machine import Machine
from parallax.plan.memory import GIB, node_host_bytes, plan_memory
from parallax.plan.workload import Workload
from parallax.run import TrainConfig
from parallax.run.option import needs_problems, problems
from parallax.run.rules import RULES

MARGIN = 0.03  # of the GPU's and the host's memory, kept free
# GPU bytes that summing gradients on the GPU leaves free beside the margin: the allocator's
# rounding and a capped card's fragmentation
FILL_RESERVE = 0.5 * GIB


@dataclass
class Result:
    """The fitting candidates, fastest first (at most ``top``), and what the search saw."""

    ranked: list[Candidate]
    searched: int
    fitting: int
    closest: list[Candidate] = field(default_factory=list)  # the smallest needs, none fitting
    problems: dict[str, int] = field(default_factory=dict)  # why candidates were refused
    machine: Machine | None = None
    usable_gpu: float = 0.0
    usable_host: float = 0.0
    # offloaded candidates that fit the GPU but not the host (split masters may fit them)
    host_short: int = 0


def option_problems(cfg: TrainConfig) -> list[str]:
    """What the options' own rules say of ``cfg`` (:mod:`parallax.run.rules` without the
    types, data and output checks, which no layout changes)."""
    return problems(cfg) + needs_problems(cfg) + [p for rule in RULES if (p := rule(cfg))]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(fixed: dict[str, Any], name: str, value: Any) -> bool:
    return name not in fixed or fixed[name] == value


def _checkpointing(model: Workload, fixed: dict[str, Any]) -> list[bool | str]:
    scopes = {p.scope for e in model.estimates for p in e.parts if p.scope}
    options: list[bool | str] = [False] + ([True] if scopes else [])
    options += sorted(scopes) if len(scopes) > 1 else []  # a scope alone is "all" again
    if "activation_checkpointing" in fixed and not fixed["activation_checkpointing"]:
        return [False]
    if "checkpoint_scope" in fixed:
        scope = fixed["checkpoint_scope"]
        return [True if scope == "all" else scope]
    if fixed.get("activation_checkpointing"):
        return [o for o in options if o]
    return options


def _memory_options(dp: int, fixed: dict[str, Any]) -> list[tuple[int, bool, bool]]:
    """(zero, share offloaded, reshard after forward) worth trying at ``dp``."""
    shares = [1.0, 0.5] if "offload_fraction" in OPTION_NAMES else [1.0]
    shares = [fixed["offload_fraction"]] if "offload_fraction" in fixed else shares
    out: list[tuple[int, float, bool]] = [(1, 0.0, True)]
    out += [(2, 0.0, True)] if dp > 1 else []
    out += [(2, share, True) for share in shares]
    if dp > 1:
        out += [(3, 0.0, True), (3, 0.0, False)]
        out += [(3, share, reshard) for share in shares for reshard in (True, False)]
    else:  # nothing to shard, but ZeRO-3 builds its buckets one at a time (a lower peak)
        out += [(3, share, True) for share in shares]
    return [
        (z, o, r)
        for z, o, r in out
        if _allowed(fixed, "zero", z)
        and _allowed(fixed, "offload", "optimizer" if o else "none")
        and (not o or _allowed(fixed, "offload_fraction", o))
        and _allowed(fixed, "reshard_after_forward", r)
    ]


def _schedules(model: Workload, pp: int, m: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    if pp == 1:
        return [(fixed.get("schedule", "1f1b"), fixed.get("chunks", 1))]
    out = [("1f1b", 1)] if m >= pp else [("gpipe", 1)]
    chunks = fixed.get("chunks", 2)
    if chunks > 1 and m % pp == 0:
        try:
            model.ranges(pp, chunks)
            out.append(("interleaved", chunks))
        except ValueError:
            pass
    if "schedule" in fixed:
        want = fixed["schedule"]
        out = [(want, chunks if want == "interleaved" else 1)]
    return [(s, c) for s, c in out if _allowed(fixed, "chunks", c)]


def layouts(model: Workload, world: int, per_node: int, fixed: dict[str, Any]):
    """Every candidate layout (before memory, rules and the family's checks)."""
    batch = model.global_batch
    for tp in divisors(min(world, per_node)):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if not all(_allowed(fixed, k, v) for k, v in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            if batch % dp:
                continue
            for mb in divisors(batch // dp):
                if not _allowed(fixed, "micro_batch_size", mb):
                    continue
                m = batch // (mb * dp)
                for schedule, chunks in _schedules(model, pp, m, fixed):
                    for zero, offload, reshard in _memory_options(dp, fixed):
                        for ckpt in _checkpointing(model, fixed):
                            kept = fixed.get("gpu_accumulation", 0.0) if offload else 0.0
                            yield Layout(
                                tp, pp, dp, mb, schedule, chunks, zero, offload, reshard, ckpt,
                                kept,
                            )  # fmt: skip


class Searcher:
    """One search's caches: the family's and the options' verdicts per layout shape."""

    def __init__(
        self, model: Workload, machine: Machine, margin: float = MARGIN, fill: bool = False
    ) -> None:
        self.model, self.machine, self.margin, self.fill = model, machine, margin, fill
        self.usable_gpu = machine.gpu_memory_gib * GIB * (1 - margin)
        self.usable_host = machine.host_memory_gib * GIB * (1 - margin)
        self._verdicts: dict[tuple, str | None] = {}

    def problem(self, layout: Layout) -> str | None:
        """Why a run would refuse ``layout`` (the family's layout checks, the pipeline split,
        the options' rules), or ``None``."""
        key = (layout.tp, layout.pp, layout.chunks, layout.schedule, layout.zero)
        key += (layout.offload, layout.reshard_after_forward, layout.checkpointing)
        if key not in self._verdicts:
            self._verdicts[key] = self._check(layout)
        return self._verdicts[key]

    def _check(self, layout: Layout) -> str | None:
        run = self.model.run
        try:
            dims = ParallelDims(tp=layout.tp, pp=layout.pp, dp=layout.dp)
            run.recipe.model.check_layout(run, dims)
            self.model.ranges(layout.pp, layout.chunks)
            self.model.params(layout.tp)  # the blocks build at this tp (heads divide)
            found = option_problems(run.replace(**layout.options()))
        except ValueError as err:
            return str(err).split(";")[0]
        return found[0] if found else None

    def evaluate(self, layout: Layout) -> Candidate:
        """Its memory (not its time); with ``fill``, an offloaded layout of several passes a
        step sums on the GPU as much of its gradient as the GPU has room for
        (:meth:`_filled`)."""
        c = self._evaluate(layout)
        passes = self.model.global_batch // (layout.dp * layout.micro_batch_size)
        if self.fill and layout.offload and not layout.accumulate and passes > 1:
            return self._filled(c)
        return c

    def _filled(self, c: Candidate) -> Candidate:
        """``c`` with the largest share of its offloaded gradients summed on the GPU that
        leaves :data:`FILL_RESERVE` of the usable memory free (whole buckets: the need grows
        by each one's bytes, so a share scaled to the room fits, less a bucket's rounding)."""
        room = self.usable_gpu - FILL_RESERVE - c.gpu
        if room <= 0:  # (a host over its memory may come within it: the sums leave it)
            return c
        whole = self._evaluate(dataclasses.replace(c.layout, accumulate=1.0))
        if whole.gpu - c.gpu <= room:
            return dataclasses.replace(whole, least_gpu=c.gpu)
        share = room / (whole.gpu - c.gpu)
        if share < 0.01:
            return c
        part = self._evaluate(dataclasses.replace(c.layout, accumulate=round(share, 3) - 0.001))
        return dataclasses.replace(part, least_gpu=c.gpu) if part.gpu <= self.usable_gpu else c

    def _evaluate(self, layout: Layout) -> Candidate:
        memory = tuple(plan_memory(self.model, layout, self.model.run.overlap_grad_reduce))
        gpu = max(r.needed(self.machine) for r in memory)
        host = node_host_bytes(list(memory), layout, self.machine.gpus_per_node)
        return Candidate(layout, memory, gpu, host, self.model.global_batch)

    def fits(self, c: Candidate) -> bool:
        return c.gpu <= self.usable_gpu and c.host <= self.usable_host

    def timed(self, c: Candidate, exact: bool = True) -> Candidate:
        t = step_time(self.model, c.layout, self.machine, list(c.memory), exact)
        return dataclasses.replace(c, time=t)


def search(
    model: Workload,
    machine: Machine,
    world: int,
    fixed: dict[str, Any] | None = None,
    top: int = 5,
    margin: float = MARGIN,
) -> Result:
    """The ``top`` fastest layouts of ``world`` GPUs (``machine.gpus_per_node`` a node) that
    fit; see the module docstring."""
    fixed = dict(fixed or {})
    for name, value in (("zero", 1), ("offload", "none"), ("reshard_after_forward", True)):
        if name not in OPTION_NAMES:  # a parallax.train without the option runs this value
            fixed.setdefault(name, value)
    s = Searcher(model, machine, margin, fill="gpu_accumulation" not in fixed)
    fitting: list[Candidate] = []
    closest: list[Candidate] = []
    problems: dict[str, int] = {}
    searched = host_short = 0
    for layout in layouts(model, world, min(machine.gpus_per_node, world), fixed):
        searched += 1
        problem = s.problem(layout)
        if problem:
            problems[problem] = problems.get(problem, 0) + 1
            continue
        c = s.evaluate(layout)
        if s.fits(c):
            fitting.append(c)
        else:
            closest.append(c)
            host_short += bool(layout.offload) and c.gpu <= s.usable_gpu
    ranked = _fastest(s, fitting, top)
    closest.sort(key=lambda c: (max(c.gpu / s.usable_gpu, c.host / s.usable_host), c.gpu))
    return Result(
        ranked=ranked,
        searched=searched,
        fitting=len(fitting),
        closest=closest[:top],
        problems=problems,
        machine=machine,
        usable_gpu=s.usable_gpu,
        usable_host=s.usable_host,
        host_short=host_short,
    )


def _fastest(s: Searcher, fitting: list[Candidate], top: int) -> list[Candidate]:
    """The ``top`` best by :func:`~parallax.plan.choice.preference`, the first one
    :func:`~parallax.plan.choice.first_choice`, simulating a pipeline only while its bound (the
    time of a pipeline without idling) can still beat the slowest of those kept (so every
    candidate of the fastest's tie bucket is timed)."""
    bounds = [(s.timed(c, exact=False).time.seconds, i) for i, c in enumerate(fitting)]
    heapq.heapify(bounds)
    best: list[Candidate] = []
    timed_all: list[Candidate] = []
    while bounds:
        bound, i = heapq.heappop(bounds)
        if len(best) >= top and bound > max(c.time.seconds for c in best) * TIE:
            break
        timed = s.timed(fitting[i])
        timed_all.append(timed)
        best = sorted([*best, timed], key=preference)[:top]
    if not best:
        return best
    first = first_choice(timed_all)
    return [first, *(c for c in best if c is not first)][:top]
