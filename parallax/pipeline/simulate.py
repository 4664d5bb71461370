"""Simulate a lowered schedule: makespan, bubble, activations in flight, or the deadlock it hides.

The model is deliberately strict: a batch of point-to-point operations completes only when every
operation in it has been matched by the peer's posted counterpart (as with large NCCL messages,
which rendezvous). A schedule that runs to completion here cannot deadlock on a real backend,
where small messages may complete earlier. Matched data messages take ``comm_time``; the small
metadata messages take none.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from parallax.pipeline.lower import Batch, Program, Times, comm_messages, lower, per_stage
from parallax.pipeline.schedule import Action, Schedule


class DeadlockError(ValueError):
    """The schedule cannot finish: every unfinished rank waits on a peer."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`. Times are in the units of the costs given."""

    schedule: Schedule
    makespan: float
    bubble_fraction: float  # 1 - busy / (ranks * makespan)
    busy: tuple[float, ...]  # compute time per rank
    peak_activations: tuple[int, ...]  # most (stage, microbatch) forwards held per rank
    spans: tuple[tuple[tuple[float, float, Action], ...], ...]  # per rank (start, end, action)

    def __str__(self) -> str:
        return format_timeline(self)


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most forwards whose backward has not run yet (from the order alone)."""
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            held += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def _batch_messages(program: Program) -> dict[tuple[int, int], list[tuple]]:
    """For every batch ``(rank, index)``: its elementary messages as ``(key, other_key, data)``."""
    schedule = program.schedule
    sent: dict = defaultdict(int)
    recvd: dict = defaultdict(int)
    out: dict[tuple[int, int], list[tuple]] = {}
    for rank, items in enumerate(program.ranks):
        for index, item in enumerate(items):
            if not isinstance(item, Batch):
                continue
            msgs = []
            for op in item.ops:
                channel, elementary = comm_messages(op, schedule)
                counter = sent if op.kind.startswith("SEND") else recvd
                side, other = ("s", "r") if op.kind.startswith("SEND") else ("r", "s")
                for kind, _, _ in elementary:
                    i = counter[channel]
                    counter[channel] += 1
                    msgs.append(((channel, i, side), (channel, i, other), kind != "M"))
            out[(rank, index)] = msgs
    return out


def _run(program: Program, cost: dict, comm_time: float) -> tuple[list[float], list[list]]:
    """Each rank's end time and its compute spans, running ``program`` with ``cost`` per action
    and ``comm_time`` per data message; :class:`DeadlockError` with every stuck rank."""
    sched = program.schedule
    messages = _batch_messages(program)
    posted: dict[tuple, float] = {}
    pc = [0] * sched.num_ranks
    clock = [0.0] * sched.num_ranks
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(sched.num_ranks)]
    progress = True
    while progress:
        progress = False
        for rank, items in enumerate(program.ranks):
            while pc[rank] < len(items):
                item = items[pc[rank]]
                if isinstance(item, Action):
                    end = clock[rank] + cost[item.kind][item.stage]
                    spans[rank].append((clock[rank], end, item))
                    clock[rank], pc[rank], progress = end, pc[rank] + 1, True
                    continue
                msgs = messages[(rank, pc[rank])]
                if msgs[0][0] not in posted:
                    for key, _, _ in msgs:
                        posted[key] = clock[rank]
                    progress = True
                if any(other not in posted for _, other, _ in msgs):
                    break  # waits for a peer
                done = max(
                    max(posted[key], posted[other]) + (comm_time if data else 0.0)
                    for key, other, data in msgs
                )
                clock[rank], pc[rank], progress = max(clock[rank], done), pc[rank] + 1, True
    _raise_if_stuck(program, pc)
    return clock, spans


def _raise_if_stuck(program: Program, pc: list[int]) -> None:
    sched = program.schedule
    stuck = [r for r in range(sched.num_ranks) if pc[r] < len(program.ranks[r])]
    if stuck:
        lines = [f"{sched.describe()} deadlocks; each unfinished rank waits at:"]
        for r in stuck:
            done = " ".join(map(str, program.ranks[r][max(0, pc[r] - 3) : pc[r]]))
            lines.append(f"  rank {r}: ... {done} >> {program.ranks[r][pc[r]]}")
        raise DeadlockError("\n".join(lines) + f"\n{sched}")


def simulate(
    schedule: Schedule | Program,
    forward_time: Times = 1.0,
    backward_time: Times = 2.0,
    comm_time: float = 0.0,
    weight_time: Times = 0.0,
) -> SimResult:
    """Run the lowered schedule against per-stage costs and return its timeline.

    ``forward_time`` / ``backward_time`` / ``weight_time`` are a number or one value per virtual
    stage (e.g. measured ones); ``comm_time`` is the time of one activation or gradient transfer.
    Raises :class:`DeadlockError` (a ``ValueError``) with the stuck step of every rank.
    """
    program = schedule if isinstance(schedule, Program) else lower(schedule)
    sched = program.schedule
    cost = {
        "F": per_stage(forward_time, sched.num_stages, "simulate: forward_time"),
        "B": per_stage(backward_time, sched.num_stages, "simulate: backward_time"),
        "W": per_stage(weight_time, sched.num_stages, "simulate: weight_time"),
    }
    clock, spans = _run(program, cost, float(comm_time))
    makespan = max(clock)
    busy = tuple(sum(end - start for start, end, _ in rank_spans) for rank_spans in spans)
    bubble = 1.0 - sum(busy) / (sched.num_ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=sched,
        makespan=makespan,
        bubble_fraction=bubble,
        busy=busy,
        peak_activations=peak_activations(sched),
        spans=tuple(tuple(s) for s in spans),
    )


def format_timeline(result: SimResult, max_columns: int = 120) -> str:
    """A text Gantt chart: one row per rank, one cell per shortest compute step, '.' = idle."""
    durations = [e - s for rank in result.spans for s, e, _ in rank if e > s]
    if not durations:
        return str(result.schedule)
    unit = min(durations)
    width = max(len(str(a)) for rank in result.spans for _, _, a in rank)
    columns = min(max_columns, round(result.makespan / unit))
    lines = [
        f"{result.schedule.describe()}: makespan {result.makespan:g}, "
        f"bubble {result.bubble_fraction:.1%}, peak activations {list(result.peak_activations)}"
    ]
    for rank, rank_spans in enumerate(result.spans):
        cells = ["." * width] * columns
        for start, end, action in rank_spans:
            first, last = round(start / unit), round(end / unit)
            for c in range(first, min(last, columns)):
                cells[c] = str(action).rjust(width) if c == first else "-" * width
        lines.append(f"rank {rank} | " + " ".join(cells))
    return "\n".join(lines)
