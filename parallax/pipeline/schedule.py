"""Pipeline schedules as plain data: for every pipeline rank, the ordered compute actions it runs.

A schedule is produced by a pure function and can be printed, checked (:func:`validate`) and
simulated (:func:`simulate`) before any process starts. The executor interprets any schedule, so
a new schedule is a new generator function and nothing else.

An :class:`Action` prints compactly as ``<stage><kind><microbatch>``: ``1F3`` is the forward of
virtual stage 1 on microbatch 3, ``0B2`` a backward; the lowering pass adds communication actions
such as ``0SEND_F3`` and ``1RECV_F3``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property

COMPUTE_KINDS = ("F", "B", "W")  # "W": weight-gradient half of a split backward (not run yet)
COMM_KINDS = ("SEND_F_META", "SEND_F", "RECV_F_META", "RECV_F", "SEND_B", "RECV_B")
_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` applied to virtual ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; use one of {COMPUTE_KINDS}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"action {self} has a negative stage or microbatch")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1F3") == Action("F", 1, 3)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F3'")
        return cls(match.group(2), int(match.group(1)), int(match.group(3)))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the notation
    return Action("F", stage, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action("B", stage, microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ordered compute actions; plus the stage -> rank placement.

    ``actions[r]`` is what pipeline rank ``r`` runs, in order. ``stage_to_rank[s]`` is the rank
    holding virtual stage ``s``. Structure is checked here; dependencies and deadlock freedom by
    :func:`parallax.pipeline.validate`.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _positive(self.name, num_ranks=self.num_ranks, num_stages=self.num_stages)
        _positive(self.name, num_microbatches=self.num_microbatches)
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"{self.name}: stage_to_rank has {len(self.stage_to_rank)} entries for "
                f"{self.num_stages} stages"
            )
        if any(not 0 <= r < self.num_ranks for r in self.stage_to_rank):
            raise ValueError(
                f"{self.name}: stage_to_rank {self.stage_to_rank} names a rank "
                f"outside [0, {self.num_ranks})"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"{self.name}: {len(self.actions)} action lists for {self.num_ranks} ranks"
            )
        for rank, acts in enumerate(self.actions):
            for a in acts:
                if not isinstance(a, Action) or not a.is_compute:
                    raise ValueError(f"{self.name}: rank {rank} has {a!s}, not a compute action")

    @property
    def chunks_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages held by pipeline rank ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of the whole schedule (identical on every process)."""
        text = repr((self.name, self.num_microbatches, self.stage_to_rank))
        text += "|".join(" ".join(map(str, acts)) for acts in self.actions)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"{self.name} ({self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches)"
        )

    def __str__(self) -> str:
        return format_schedule(self)


def format_schedule(schedule: Schedule, max_actions: int = 48) -> str:
    """A compact table, one row per rank: ``rank 0 | 0F0 0F1 0B0 ...``."""
    rows = [schedule.describe()]
    width = max((len(str(a)) for acts in schedule.actions for a in acts), default=3)
    for rank, acts in enumerate(schedule.actions):
        cells = [str(a).rjust(width) for a in acts[:max_actions]]
        more = f" ... (+{len(acts) - max_actions})" if len(acts) > max_actions else ""
        rows.append(f"rank {rank} | " + " ".join(cells) + more)
    return "\n".join(rows)


def _positive(what: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}: {name} must be a positive integer, got {value!r}")


def _identity_placement(num_stages: int) -> tuple[int, ...]:
    return tuple(range(num_stages))


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe). Every microbatch's activations stay alive at
    once, so peak memory is ``num_microbatches`` on every rank."""
    _positive("gpipe", num_stages=num_stages, num_microbatches=num_microbatches)
    m = num_microbatches
    actions = tuple(
        tuple(F(r, i) for i in range(m)) + tuple(B(r, i) for i in range(m))
        for r in range(num_stages)
    )
    return Schedule("GPipe", num_stages, num_stages, m, _identity_placement(num_stages), actions)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B: ``p - rank - 1`` warm-up forwards, then one forward / one backward,
    then the remaining backwards. Same bubble as GPipe, but at most ``p - rank`` microbatches in
    flight on a rank."""
    _positive("one_f_one_b", num_stages=num_stages, num_microbatches=num_microbatches)
    p, m = num_stages, num_microbatches
    if m < p:
        raise ValueError(
            f"one_f_one_b: {m} microbatches cannot fill {p} stages; use num_microbatches >= {p} "
            f"(ideally several times {p}), or gpipe({p}, {m})"
        )
    actions = []
    for r in range(p):
        warmup = p - r - 1
        acts = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(r, warmup + i), B(r, i)]
        acts += [B(r, i) for i in range(m - warmup, m)]
        actions.append(tuple(acts))
    return Schedule("1F1B", p, p, m, _identity_placement(p), tuple(actions))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks_per_rank: int) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline): each rank holds ``chunks_per_rank`` model
    chunks, virtual stage ``s`` on rank ``s % num_ranks``. Microbatches advance in groups of
    ``num_ranks``; the bubble shrinks by about ``chunks_per_rank`` at the cost of more messages.
    With one chunk per rank this is :func:`one_f_one_b`."""
    _positive(
        "interleaved_1f1b",
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        chunks_per_rank=chunks_per_rank,
    )
    p, m, v = num_ranks, num_microbatches, chunks_per_rank
    if v == 1:
        return one_f_one_b(p, m)
    if m % p != 0:
        lower, upper = max(p, m // p * p), (m // p + 1) * p
        raise ValueError(
            f"interleaved_1f1b: {m} microbatches is not a multiple of {p} ranks (microbatches "
            f"move through the chunks in groups of {p}); use {lower} or {upper}"
        )
    total = m * v  # (chunk, microbatch) pairs per rank

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    actions = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [F(c * p + r, mb) for c, mb in (unit(k, False) for k in range(total))]
        bwd = [B(c * p + r, mb) for c, mb in (unit(k, True) for k in range(total))]
        acts = fwd[:warmup]
        for i in range(total - warmup):
            acts += [fwd[warmup + i], bwd[i]]
        acts += bwd[total - warmup :]
        actions.append(tuple(acts))
    placement = tuple(s % p for s in range(p * v))
    return Schedule(f"Interleaved1F1B(v={v})", p, p * v, m, placement, tuple(actions))


def theoretical_bubble(schedule: Schedule) -> float:
    """The textbook bubble fraction with equal stage costs and free communication:
    ``(p - 1) / (v * m + p - 1)`` (``v = 1`` for GPipe and 1F1B)."""
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.chunks_per_rank
    return (p - 1) / (v * m + p - 1)


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def make_schedule(name: str, pp: int, num_microbatches: int, chunks: int) -> Schedule:
    """The schedule named by ``--schedule``; raises ``ValueError`` saying what would work."""
    if name == "gpipe":
        return gpipe(pp, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, num_microbatches)
    if name == "interleaved":
        return interleaved_1f1b(pp, num_microbatches, chunks)
    raise ValueError(f"unknown schedule {name!r}: use {', '.join(SCHEDULES)}")
