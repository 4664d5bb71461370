"""Lowering: add the sends and receives to a schedule, so every rank knows its exact program.

Messages between two ranks travel on a *channel* ``(src, dst)`` and are matched in posting order
(NCCL and gloo both pair point-to-point operations per peer that way). With two ranks, prev and
next are the same peer; the two directions are two channels and never mix.

A forward message is two elementary messages: a small fixed-size metadata tensor (shapes and
dtypes, so sequence lengths may vary per microbatch), then the activations. Gradients need no
metadata: the receiver sent the matching activations and knows their shapes. A receiver posts
the activation receive in a batch after the metadata receive, whose contents size the buffer.

Each rank's program alternates :class:`Batch` (communication posted together and waited for
together) and compute :class:`~parallax.pipeline.schedule.Action`. :func:`lower` decides where
each message goes so that both ends post it at about the same time and no order of completion
can deadlock (see its docstring).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from parallax.pipeline.messages import (
    Channel,
    Message,
    channel_orders,
    comm_messages,
    needed_message,
    pairing_keys,
    send_phases,
    sends_after,
)
from parallax.pipeline.schedule import Action, Schedule

__all__ = [
    "Batch",
    "Channel",
    "Item",
    "Message",
    "Program",
    "Times",
    "channel_orders",
    "comm_messages",
    "lower",
    "needed_message",
    "pairing_keys",
    "per_stage",
    "sends_after",
]

Times = float | Sequence[float]

_RECV_KIND = {"M": "RECV_F_META", "F": "RECV_F", "B": "RECV_B"}


@dataclass(frozen=True)
class Batch:
    """Communication actions posted as one batch and waited for together."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " ".join(map(str, self.ops)) + "]"


Item = Action | Batch


@dataclass(frozen=True)
class Program:
    """A lowered schedule: per pipeline rank, the items it executes in order."""

    schedule: Schedule
    ranks: tuple[tuple[Item, ...], ...]
    costs: tuple = ()  # the reference costs the messages were placed with

    @property
    def fingerprint(self) -> str:
        """Identical on every process that lowered the same schedule with the same costs."""
        return hashlib.sha256(f"{self.schedule.fingerprint}{self.costs}".encode()).hexdigest()[:16]

    def __str__(self) -> str:
        rows = [self.schedule.describe() + ", lowered"]
        for rank, items in enumerate(self.ranks):
            rows.append(f"rank {rank} | " + " ".join(map(str, items)))
        return "\n".join(rows)


def _batches(events: list[tuple[tuple, Action]], schedule: Schedule) -> list[Batch]:
    """Group one slot's events (already in global order) into batches, in that order.

    A batch is cut before an activation receive whose metadata it holds (the metadata sizes the
    buffer), and wherever it would hold sends and receives that NCCL pairs (see
    :func:`pairing_keys`) with more than one of them either way. NCCL runs the k-th send and
    the k-th receive of a key as one pair and the pairs one after the other, so a batch with two
    sends and one receive could wait on its first pair while the peer waits on the second
    (interleaved 1F1B on two GPUs hung that way; gloo, which buffers sends, did not). Sends
    only, or receives only, run in order as separate batches would; one send and one receive
    are a single pair.
    """
    batches: list[list[Action]] = [[]]
    counts: dict[tuple, int] = defaultdict(int)  # (key, is send) -> operations in the batch
    metas: set[tuple[int, int]] = set()
    for _, op in events:
        send, keys = pairing_keys(op, schedule)
        clash = any(
            counts[(k, not send)] and max(counts[(k, send)] + 1, counts[(k, not send)]) > 1
            for k in keys
        )
        if clash or (op.kind == "RECV_F" and (op.stage, op.microbatch) in metas):
            batches.append([])
            counts, metas = defaultdict(int), set()
        for k in keys:
            counts[(k, send)] += 1
        if op.kind == "RECV_F_META":
            metas.add((op.stage, op.microbatch))
        batches[-1].append(op)
    return [Batch(tuple(ops)) for ops in batches if ops]


def _ready(action: Action, schedule: Schedule, done: set, arrived: set) -> bool:
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind == "W":
        return ("B", s, m) in done
    if action.kind == "B" and ("F", s, m) not in done:
        return False
    dep = ("F", s - 1, m) if action.kind == "F" else ("B", s + 1, m)
    if not 0 <= dep[1] <= last:
        return True
    if schedule.rank_of(dep[1]) == schedule.rank_of(s):
        return dep in done
    return (action.kind, s, m) in arrived


def per_stage(value: Times, num_stages: int, what: str) -> tuple[float, ...]:
    """A number or one value per virtual stage, as a tuple of ``num_stages`` floats >= 0."""
    if isinstance(value, int | float):
        values = (float(value),) * num_stages
    else:
        values = tuple(float(v) for v in value)
        if len(values) != num_stages:
            raise ValueError(f"{what} has {len(values)} entries for {num_stages} stages")
    if any(v < 0 for v in values):
        raise ValueError(f"{what} must be >= 0, got {values}")
    return values


class _Placement:
    """One run of the schedule with reference costs, placing each message: a rank finishes what
    ends now, exchanges with every peer that is between two actions too, then starts what it
    can (see :func:`lower`)."""

    def __init__(self, schedule: Schedule, cost: dict[str, tuple[float, ...]]) -> None:
        self.schedule, self.cost = schedule, cost
        ranks = range(schedule.num_ranks)
        self.items: list[list[Item]] = [[] for _ in ranks]
        self.pending: list[list[tuple[Channel, Action, list]]] = [[] for _ in ranks]
        self.busy_until: list[float | None] = [None for _ in ranks]
        self.running: list[Action | None] = [None for _ in ranks]
        self.pc = [0 for _ in ranks]
        self.done: set[tuple[str, int, int]] = set()
        self.arrived: set[tuple[str, int, int]] = set()
        self.count: dict[Channel, int] = defaultdict(int)

    def run(self) -> list[list[Item]]:
        t = 0.0
        while True:
            self._finish(t)
            self._exchange(t)
            self._start(t)
            active = [b for b in self.busy_until if b is not None]
            if not active:
                break
            t = min(active)
        stuck = [r for r, acts in enumerate(self.schedule.actions) if self.pc[r] < len(acts)]
        if stuck:
            acts = self.schedule.actions
            waits = ", ".join(f"rank {r} at {acts[r][self.pc[r]]}" for r in stuck)
            raise ValueError(
                f"{self.schedule.name}: the order cannot run, it waits forever: {waits}\n"
                f"{self.schedule}"
            )
        return self.items

    def _finish(self, t: float) -> None:
        """What ends at ``t`` is done; its messages become pending."""
        for r, until in enumerate(self.busy_until):
            if until != t:
                continue
            action = self.running[r]
            self.done.add((action.kind, action.stage, action.microbatch))
            for send in sends_after(action, self.schedule):
                first, second = send_phases(send)
                parts = []
                for op in first + second:
                    channel, (msg,) = comm_messages(op, self.schedule)
                    parts.append(((t, *channel, self.count[channel]), op, msg))
                    self.count[channel] += 1
                self.pending[r].append((channel, send, parts))
            self.busy_until[r], self.running[r] = None, None

    def _exchange(self, t: float) -> None:
        """Every idle rank exchanges its pending messages with the idle peers they go to."""
        events: dict[int, list[tuple[tuple, Action]]] = defaultdict(list)
        for r, until in enumerate(self.busy_until):
            if until is not None:
                continue
            keep = []
            for channel, send, parts in self.pending[r]:
                if self.busy_until[channel[1]] is not None:
                    keep.append((channel, send, parts))
                    continue
                for key, op, msg in parts:
                    events[r].append(((t, *key[1:]), op))
                    recv = Action(_RECV_KIND[msg[0]], *msg[1:])
                    events[channel[1]].append(((t, *key[1:]), recv))
                consumer = ("F", send.stage + 1) if send.kind == "SEND_F" else ("B", send.stage - 1)
                self.arrived.add((*consumer, send.microbatch))
            self.pending[r] = keep
        for r, evs in events.items():
            self.items[r].extend(_batches(sorted(evs, key=lambda e: e[0]), self.schedule))

    def _start(self, t: float) -> None:
        """Every idle rank starts its next action if its inputs are there."""
        for r, acts in enumerate(self.schedule.actions):
            free = self.busy_until[r] is None and self.pc[r] < len(acts)
            if free and _ready(acts[self.pc[r]], self.schedule, self.done, self.arrived):
                action = self.running[r] = acts[self.pc[r]]
                self.busy_until[r] = t + self.cost[action.kind][action.stage]
                self.items[r].append(action)
                self.pc[r] += 1


def lower(
    schedule: Schedule,
    forward_time: Times = 1.0,
    backward_time: Times = 2.0,
    weight_time: Times = 1.0,
) -> Program:
    """Add batched sends and receives to every rank's compute actions (cached per schedule).

    The placement comes from running the schedule once with reference costs (by default forward
    1, backward 2, or measured ones per virtual stage): a message is exchanged as soon as its
    sender and its receiver are both between two compute actions, and a rank with work it can
    do does it rather than wait for a busy peer. Every rank then meets its messages in one
    global order (exchange time, then sender, receiver and position on the channel) that
    respects every dependency. That order is what rules out deadlock even where a send completes
    only once its receive is posted (large NCCL messages): the smallest unfinished message
    always has both ends posted. The messages a rank exchanges at one time are posted together,
    in batches cut only where NCCL's pairing of sends and receives needs it (see ``_batches``),
    which pairs the sends and receives of two stages facing each other.

    Raises ``ValueError`` when the order itself cannot run: a rank waits for a result that
    depends on one of its own later actions.
    """
    n = schedule.num_stages
    cost = {
        "F": per_stage(forward_time, n, "forward_time"),
        "B": per_stage(backward_time, n, "backward_time"),
        "W": per_stage(weight_time, n, "weight_time"),
    }
    if any(c <= 0 for kind in ("F", "B") for c in cost[kind]):
        raise ValueError("lower: forward and backward times must be > 0 to place messages")
    cache = schedule.__dict__.setdefault("_programs", {})
    key = tuple(cost.values())
    if key in cache:
        return cache[key]
    items = _Placement(schedule, cost).run()
    program = Program(schedule, tuple(tuple(rank_items) for rank_items in items), key)
    cache[key] = program
    return program
