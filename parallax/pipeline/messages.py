"""The messages of a pipeline schedule: which sends a compute action's results need, which
remote message an action consumes, and the channel ``(src, dst)`` and elementary messages of each
communication action (:mod:`parallax.pipeline.lower` places them; the module docstring there says
how messages are matched).
"""

from __future__ import annotations

from collections import defaultdict

from parallax.pipeline.schedule import Action, Schedule

Channel = tuple[int, int]  # (src rank, dst rank)
# ("M" metadata | "F" activations | "B" gradients, receiving stage, microbatch)
Message = tuple[str, int, int]

_MSG_KIND = {"RECV_F_META": "M", "RECV_F": "F"}


def sends_after(action: Action, schedule: Schedule) -> list[Action]:
    """The send actions that ``action``'s results need (none when the peer stage is local)."""
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    here = schedule.rank_of(s)
    if action.kind == "F" and s < last and schedule.rank_of(s + 1) != here:
        return [Action("SEND_F", s, m)]
    if action.kind == "B" and s > 0 and schedule.rank_of(s - 1) != here:
        return [Action("SEND_B", s, m)]
    return []


def needed_message(action: Action, schedule: Schedule) -> tuple[Channel, Message] | None:
    """The remote message a compute action consumes, with its channel, or ``None``."""
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    here = schedule.rank_of(s)
    if action.kind == "F" and s > 0 and schedule.rank_of(s - 1) != here:
        return (schedule.rank_of(s - 1), here), ("F", s, m)
    if action.kind == "B" and s < last and schedule.rank_of(s + 1) != here:
        return (schedule.rank_of(s + 1), here), ("B", s, m)
    return None


def comm_messages(op: Action, schedule: Schedule) -> tuple[Channel, list[Message]]:
    """The channel and elementary message of one communication action."""
    s, m = op.stage, op.microbatch
    if op.kind == "SEND_F_META":
        return (schedule.rank_of(s), schedule.rank_of(s + 1)), [("M", s + 1, m)]
    if op.kind == "SEND_F":
        return (schedule.rank_of(s), schedule.rank_of(s + 1)), [("F", s + 1, m)]
    if op.kind == "SEND_B":
        return (schedule.rank_of(s), schedule.rank_of(s - 1)), [("B", s - 1, m)]
    if op.kind == "RECV_B":
        return (schedule.rank_of(s + 1), schedule.rank_of(s)), [("B", s, m)]
    if op.kind in ("RECV_F_META", "RECV_F"):
        return (schedule.rank_of(s - 1), schedule.rank_of(s)), [(_MSG_KIND[op.kind], s, m)]
    raise ValueError(f"{op} is not a communication action")


def send_phases(send: Action) -> tuple[list[Action], list[Action]]:
    """A forward send is its metadata, then the activations."""
    if send.kind == "SEND_F":
        return [Action("SEND_F_META", send.stage, send.microbatch)], [send]
    return [], [send]


def channel_orders(schedule: Schedule) -> dict[Channel, list[Message]]:
    """Per channel, the sender's order of elementary messages."""
    orders: dict[Channel, list[Message]] = defaultdict(list)
    for acts in schedule.actions:
        for action in acts:
            for send in sends_after(action, schedule):
                first, second = send_phases(send)
                for op in first + second:
                    channel, msgs = comm_messages(op, schedule)
                    orders[channel].extend(msgs)
    return dict(orders)


def pairing_keys(op: Action, schedule: Schedule) -> tuple[bool, tuple[tuple[str, int], ...]]:
    """Whether ``op`` is a send, and the keys under which NCCL may pair it with operations of
    the other direction in one batch: the peer, and the ring distance. NCCL schedules a batch's
    point-to-point operations in rounds, each sending ``d`` ranks ahead and receiving from ``d``
    ranks behind; with two ranks both are the same peer."""
    (src, dst), _msgs = comm_messages(op, schedule)
    n = schedule.num_ranks
    if op.kind.startswith("SEND"):
        return True, (("peer", dst), ("distance", (dst - src) % n))
    return False, (("peer", src), ("distance", (dst - src) % n))
