"""``validate(schedule)``: everything that can be checked about a schedule without processes;
``rank_problem``: what can be checked about one rank's arguments to ``run_schedule``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from parallax.pipeline.lower import (
    Batch,
    Channel,
    Message,
    Program,
    channel_orders,
    comm_messages,
    lower,
    pairing_keys,
)
from parallax.pipeline.schedule import Action, Schedule
from parallax.pipeline.simulate import simulate

if TYPE_CHECKING:
    from parallax.context import ParallelContext
    from parallax.pipeline.stage import PipelineStage


def _fail(schedule: Schedule, message: str) -> None:
    raise ValueError(f"{schedule.name}: {message}\n{schedule}")


def _check_actions(schedule: Schedule) -> None:
    """Exactly one F and one B per (stage, microbatch) on the stage's rank, F before B (before W),
    and a rank running two neighbouring stages runs them in dependency order."""
    expected = {
        (s, m) for s in range(schedule.num_stages) for m in range(schedule.num_microbatches)
    }
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        counts = Counter((a.kind, a.stage, a.microbatch) for a in acts)
        for key, n in counts.items():
            if n > 1:
                _fail(schedule, f"rank {rank} runs {key[1]}{key[0]}{key[2]} {n} times")
        for pos, a in enumerate(acts):
            if (a.stage, a.microbatch) not in expected:
                _fail(
                    schedule,
                    f"rank {rank} runs {a}, outside {schedule.num_stages} stages x "
                    f"{schedule.num_microbatches} microbatches",
                )
            if schedule.rank_of(a.stage) != rank:
                _fail(
                    schedule,
                    f"rank {rank} runs {a}, but stage {a.stage} lives on rank "
                    f"{schedule.rank_of(a.stage)}",
                )
            where[(a.kind, a.stage, a.microbatch)] = (rank, pos)
    for s, m in sorted(expected):
        for kind in ("F", "B"):
            if (kind, s, m) not in where:
                _fail(schedule, f"no rank runs {s}{kind}{m}")
        if where[("F", s, m)][1] > where[("B", s, m)][1]:
            _fail(schedule, f"{s}B{m} comes before {s}F{m}")
        if ("W", s, m) in where and where[("W", s, m)][1] < where[("B", s, m)][1]:
            _fail(schedule, f"{s}W{m} comes before {s}B{m}")
        for kind, dep in (("F", s - 1), ("B", s + 1)):
            if not 0 <= dep < schedule.num_stages:
                continue
            (r, pos), (r_dep, pos_dep) = where[(kind, s, m)], where[(kind, dep, m)]
            if r == r_dep and pos_dep > pos:
                _fail(schedule, f"rank {r} runs {s}{kind}{m} before {dep}{kind}{m}, its input")


def _check_pairing(program: Program) -> None:
    """Every channel carries the schedule's messages in the sender's compute order, as posted
    by the sender and as posted by the receiver (matched by position: a receive posted for
    the wrong message would take another message's bytes)."""
    schedule = program.schedule
    posted: dict[bool, dict[Channel, list[Message]]] = {True: {}, False: {}}
    for items in program.ranks:
        for item in items:
            if isinstance(item, Batch):
                for op in item.ops:
                    channel, msgs = comm_messages(op, schedule)
                    posted[op.kind.startswith("SEND")].setdefault(channel, []).extend(msgs)
    expected = channel_orders(schedule)
    for send, channels in posted.items():
        for channel in sorted(set(expected) | set(channels)):
            want, got = expected.get(channel, []), channels.get(channel, [])
            if got != want:
                _fail(schedule, _mismatch(channel, send, want, got))


def _op_of(message: Message, send: bool) -> Action:
    """The communication action that posts ``message`` (kind, receiving stage, microbatch)."""
    kind, stage, m = message
    if not send:
        return Action({"M": "RECV_F_META", "F": "RECV_F", "B": "RECV_B"}[kind], stage, m)
    if kind == "B":
        return Action("SEND_B", stage + 1, m)
    return Action("SEND_F_META" if kind == "M" else "SEND_F", stage - 1, m)


def _mismatch(channel: Channel, send: bool, want: list, got: list) -> str:
    """Where one end of a channel first departs from the messages the schedule sends."""
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    should = _op_of(want[i], send) if i < len(want) else "nothing"
    posts = _op_of(got[i], send) if i < len(got) else "nothing"
    end = "sending" if send else "receiving"
    return (
        f"rank {channel[0]} -> rank {channel[1]}, {end} end: message {i} should be {should}, "
        f"the program posts {posts} ({len(want)} messages expected, {len(got)} posted)"
    )


def _check_rounds(program: Program) -> None:
    """The program completes under NCCL's pairing of point-to-point operations.

    Within one batch NCCL pairs the k-th send with the k-th receive of the same pairing key
    (the peer, or the ring distance: see :func:`~parallax.pipeline.lower.pairing_keys`; both are
    checked) and runs the pairs in order; a pair finishes when both of its operations have met
    their counterparts, which must be in the peer's current pair. Messages on a channel match
    in posting order. This is stricter than the simulator, where a posted message completes as
    soon as the peer posts its end.
    """
    for kind in ("peer", "distance"):
        _run_rounds(program, kind)


def _run_rounds(program: Program, kind: str) -> None:
    schedule = program.schedule
    rounds: list[list[set]] = []  # per rank: the pairs of every batch, in order
    for items in program.ranks:
        seen: Counter = Counter()
        pairs: list[set] = []
        for item in items:
            if not isinstance(item, Batch):
                continue
            by_key: dict[tuple, tuple[list, list]] = {}
            for op in item.ops:
                channel, _ = comm_messages(op, schedule)
                send, keys = pairing_keys(op, schedule)
                key = next(k for k in keys if k[0] == kind)
                message = (channel, seen[channel])
                seen[channel] += 1
                by_key.setdefault(key, ([], []))[0 if send else 1].append((message, str(op)))
            depth = max((max(len(s), len(r)) for s, r in by_key.values()), default=0)
            for k in range(depth):
                pairs.append({x for s, r in by_key.values() for x in s[k : k + 1] + r[k : k + 1]})
        rounds.append(pairs)
    at = [0] * len(rounds)
    while True:
        current = {r: rounds[r][at[r]] for r in range(len(rounds)) if at[r] < len(rounds[r])}
        if not current:
            return
        posted = Counter(message for pair in current.values() for message, _ in pair)
        moved = False
        for r, pair in current.items():
            met = {x for x in pair if posted[x[0]] == 2}  # both ends of the message are up
            if met:
                pair -= met
                moved = True
            if not pair:
                at[r] += 1
        if not moved:
            waits = "; ".join(
                f"rank {r} at {' '.join(sorted(op for _, op in pair))}"
                for r, pair in current.items()
            )
            _fail(
                schedule,
                f"the batches deadlock under NCCL's send/receive pairing by {kind}: {waits}",
            )


def validate(schedule: Schedule) -> Program:
    """Check a schedule and return its lowered program; raise ``ValueError`` naming the step.

    Checks: each (stage, microbatch) has exactly one F and one B on the stage's rank, F before B;
    local stage-to-stage dependencies are in order; every channel carries the messages the
    schedule sends, in its order, on both ends; the batches cannot deadlock under NCCL's pairing
    of sends and receives; and the program runs to completion in the simulator.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    _check_actions(schedule)
    program = lower(schedule)
    _check_pairing(program)
    _check_rounds(program)
    simulate(program)  # raises DeadlockError (a ValueError) naming every stuck rank
    return program


def rank_problem(
    schedule: Schedule,
    stages: Sequence[PipelineStage],
    ctx: ParallelContext,
    inputs: Sequence | None,
    targets: Sequence | None,
    loss_fn: Callable | None,
) -> str | None:
    """What is wrong with this rank's arguments to ``run_schedule`` (its stages, inputs, targets,
    loss, and the schedule itself), as one sentence with the numbers, or ``None``."""
    pp, rank = ctx.pp_size, ctx.pp_rank
    if schedule.num_ranks != pp:
        return (
            f"the schedule {schedule.describe()} is for {schedule.num_ranks} pipeline ranks but "
            f"this run has pp={pp}; build it with {pp} ranks"
        )
    for stage in stages:
        if stage.num_stages != schedule.num_stages:
            return (
                f"stage {stage.stage_index} was built for {stage.num_stages} stages but the "
                f"schedule has {schedule.num_stages} (pp={pp} x {schedule.chunks_per_rank} chunks "
                "per rank)"
            )
    have = sorted(stage.stage_index for stage in stages)
    want = list(schedule.stages_of(rank))
    if have != want:
        return f"pp rank {rank} holds stages {have} but the schedule places stages {want} on it"
    m = schedule.num_microbatches
    if 0 in want and (inputs is None or len(inputs) != m):
        got = "no" if inputs is None else len(inputs)
        return f"the first stage got {got} input microbatches for a schedule of {m} microbatches"
    if schedule.num_stages - 1 in want:
        if targets is None or len(targets) != m:
            got = "no" if targets is None else len(targets)
            return f"the last stage got {got} targets for a schedule of {m} microbatches"
        if not callable(loss_fn):
            return "the last stage needs a loss_fn(output, target) -> scalar"
    try:
        if not schedule.__dict__.get("_validated"):
            validate(schedule)
            schedule.__dict__["_validated"] = True
    except ValueError as err:
        return f"invalid schedule: {err}"
    return None
