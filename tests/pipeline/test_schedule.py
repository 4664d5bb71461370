"""Schedules as data: generated, lowered, validated and simulated with no processes."""

import importlib
import re

import pytest

from parallax.pipeline import (
    Action,
    Batch,
    DeadlockError,
    Schedule,
    format_timeline,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    simulate,
    theoretical_bubble,
    validate,
)
from parallax.pipeline.lower import comm_messages


def _combos():
    """(p, m, v) over stages 1..8, microbatches 1..32, chunks 1..4 (for p up to 4 every m up to
    12 and 31, 32; a spread that keeps the edge cases m < p, m = p, m % p != 0 for all)."""
    for p in range(1, 9):
        spread = {1, max(p - 1, 1), p, p + 1, 2 * p, 3 * p + 1, 4 * p}
        ms = sorted(spread | {*range(1, 13), 31, 32}) if p <= 4 else sorted(spread)
        for m in ms:
            for v in range(1, 5):
                yield p, m, v


def _build(kind: str, p: int, m: int, v: int):
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    return interleaved_1f1b(p, m, v)


def test_every_schedule_validates_and_simulates_to_the_theoretical_bubble():
    checked = 0
    for p, m, v in _combos():
        for kind in ("gpipe", "1f1b") if v == 1 else ("interleaved",):
            needs_more = (kind == "1f1b" and m < p) or (kind == "interleaved" and m % p != 0)
            if needs_more:
                with pytest.raises(ValueError, match="use"):
                    _build(kind, p, m, v)
                continue
            program = validate(_build(kind, p, m, v))  # the lowered schedule, simulated as is
            result = simulate(program, forward_time=1.0, backward_time=2.0)
            expected = (p - 1) / (v * m + p - 1)
            assert result.bubble_fraction == pytest.approx(expected, abs=1e-12), (kind, p, m, v)
            assert result.makespan == pytest.approx(3.0 * m * v / (1 - expected))
            peaks = result.peak_activations
            if kind == "gpipe":
                assert peaks == (m,) * p
            elif kind == "1f1b":
                assert all(peaks[r] <= p - r for r in range(p)), peaks
            elif p > 1:
                assert result.bubble_fraction < simulate(one_f_one_b(p, m)).bubble_fraction
            checked += 1
    assert checked == 284  # every combination that builds (the grid above)


@pytest.mark.parametrize("forward,backward", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)])
def test_gpipe_and_1f1b_reach_theory_whatever_the_costs(forward, backward):
    for p, m in [(2, 2), (3, 7), (4, 8), (8, 16)]:
        for schedule in (gpipe(p, m), one_f_one_b(p, m)):
            result = simulate(schedule, forward, backward)
            assert result.bubble_fraction == pytest.approx(theoretical_bubble(schedule))


def test_interleaved_lowered_with_measured_costs_reaches_theory():
    schedule = interleaved_1f1b(4, 16, 2)
    costs = dict(forward_time=1.0, backward_time=1.0)
    tuned = simulate(lower(schedule, **costs), **costs).bubble_fraction
    assert tuned == pytest.approx(theoretical_bubble(schedule))
    assert simulate(schedule, **costs).bubble_fraction >= tuned  # placed for backward = 2


def test_per_stage_costs_and_comm_time():
    schedule = one_f_one_b(2, 4)
    even = simulate(schedule, 1.0, 2.0)
    slow_last = simulate(schedule, [1.0, 2.0], [2.0, 4.0])
    assert slow_last.makespan > even.makespan
    assert slow_last.busy == (12.0, 24.0)
    assert simulate(schedule, 1.0, 2.0, comm_time=0.5).makespan > even.makespan
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        simulate(schedule, [1.0, 1.0, 1.0])


def test_actions_print_and_parse():
    assert str(Action("F", 1, 3)) == "1F3"
    assert Action.parse("12B7") == Action("B", 12, 7)
    assert Action.parse("0SEND_F_META2") == Action("SEND_F_META", 0, 2)
    with pytest.raises(ValueError):
        Action.parse("F3")
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("X", 0, 0)


def test_schedule_prints_as_a_table():
    text = str(one_f_one_b(2, 3))
    assert text.splitlines() == [
        "1F1B (2 ranks, 2 stages, 3 microbatches)",
        "rank 0 | 0F0 0F1 0B0 0F2 0B1 0B2",
        "rank 1 | 1F0 1B0 1F1 1B1 1F2 1B2",
    ]
    assert "rank 1 |" in format_timeline(simulate(gpipe(2, 2)))


def test_interleaved_places_stage_s_on_rank_s_mod_p():
    schedule = interleaved_1f1b(4, 8, 3)
    assert schedule.num_stages == 12 and schedule.chunks_per_rank == 3
    assert schedule.stages_of(1) == (1, 5, 9)
    assert interleaved_1f1b(3, 6, 1) == one_f_one_b(3, 6)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gpipe(0, 4), "num_stages must be a positive integer"),
        (lambda: gpipe(2, 0), "num_microbatches must be a positive integer"),
        (
            lambda: one_f_one_b(4, 3),
            "3 microbatches cannot fill 4 stages; use num_microbatches >= 4",
        ),
        (lambda: interleaved_1f1b(4, 6, 2), "not a multiple of 4 ranks .*use 4 or 8"),
        (lambda: interleaved_1f1b(2, 4, 0), "chunks_per_rank must be a positive integer"),
    ],
)
def test_bad_arguments_say_what_would_work(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _custom(rows, num_stages=2, m=2):
    actions = tuple(tuple(Action.parse(a) for a in row.split()) for row in rows)
    return Schedule("custom", len(rows), num_stages, m, tuple(range(num_stages)), actions)


@pytest.mark.parametrize(
    "rows,match",
    [
        (["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"], "no rank runs 0B1"),
        (["0F0 0F1 0B0 0B1 0B1", "1F0 1F1 1B0 1B1"], "runs 0B1 2 times"),
        (["0F0 0B0 0F1 0B1 1F0", "1F1 1B0 1B1"], "stage 1 lives on rank 1"),
        (["0B0 0F0 0F1 0B1", "1F0 1F1 1B0 1B1"], "0B0 comes before 0F0"),
        (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], "waits forever"),
        # a whole microbatch missing
        (["0F0 0B0", "1F0 1B0"], "no rank runs 0F1"),
        # a microbatch the schedule does not have
        (["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1B0 1B1"], "runs 0F2, outside 2 stages x 2"),
        # a cycle: rank 0 waits for 1B0 before 0F1, rank 1 for 0F1 before 1B0
        (["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], "waits forever: rank 0 at 0B0, rank 1 at 1F1"),
    ],
)
def test_invalid_custom_schedules_are_named(rows, match):
    """Broken by hand, each in one way; the message names the action."""
    with pytest.raises(ValueError, match=match):
        validate(_custom(rows))


def test_room_for_split_backward_w_actions():
    base = one_f_one_b(2, 3)
    rows = []
    for acts in base.actions:
        row = []
        for a in acts:
            row.append(a)
            if a.kind == "B":
                row.append(Action("W", a.stage, a.microbatch))
        rows.append(tuple(row))
    split = Schedule("1F1B+W", 2, 2, 3, (0, 1), tuple(rows))
    validate(split)
    assert simulate(split, 1.0, 1.0, weight_time=1.0).makespan > simulate(base, 1.0, 1.0).makespan
    early = (rows[0][:5] + (rows[0][6], rows[0][5]) + rows[0][7:], rows[1])  # 0W1 before 0B1
    with pytest.raises(ValueError, match="0W1 comes before 0B1"):
        validate(Schedule("bad", 2, 2, 3, (0, 1), early))


def test_local_stage_order_is_checked():
    bad = Schedule(
        "custom",
        1,
        2,
        1,
        (0, 0),
        ((Action.parse("1F0"), Action.parse("0F0"), Action.parse("1B0"), Action.parse("0B0")),),
    )
    with pytest.raises(ValueError, match="runs 1F0 before 0F0, its input"):
        validate(bad)


def _rows(schedule) -> list[str]:
    return [" ".join(map(str, acts)) for acts in schedule.actions]


def test_small_schedules_are_the_published_orders():
    """Written out by hand from each schedule's definition."""
    # GPipe: every forward, then every backward
    assert _rows(gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]
    # 1F1B: rank r runs p - 1 - r warm-up forwards, then one forward one backward, then drains
    assert _rows(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    # interleaved (Megatron-LM): rank r holds stages r and r + p; forwards take microbatches in
    # groups of p per chunk (chunk 0, then chunk 1), backwards the chunks in reverse; rank r
    # warms up with (p - 1 - r) * 2 + (v - 1) * p forwards: 4 on rank 0, 2 on rank 1
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    assert _rows(schedule) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_small_lowered_programs_written_out():
    """Each forward sends its metadata and activations together; the receiver takes the
    metadata first (it sizes the buffer), then the activations; a backward's gradient goes
    back right after it."""
    assert str(lower(gpipe(2, 2))).splitlines()[1:] == [
        "rank 0 | 0F0 [0SEND_F_META0 0SEND_F0] 0F1 [0SEND_F_META1 0SEND_F1] [0RECV_B0] 0B0 "
        "[0RECV_B1] 0B1",
        "rank 1 | [1RECV_F_META0] [1RECV_F0] 1F0 [1RECV_F_META1] [1RECV_F1] 1F1 1B0 [1SEND_B0] "
        "1B1 [1SEND_B1]",
    ]
    assert str(lower(one_f_one_b(2, 2))).splitlines()[2] == (
        "rank 1 | [1RECV_F_META0] [1RECV_F0] 1F0 [1RECV_F_META1] [1RECV_F1] 1B0 [1SEND_B0] 1F1 "
        "1B1 [1SEND_B1]"
    )


def _posted(program, rank: int, prefix: str) -> str:
    """This rank's communication actions of one direction, in program order."""
    ops = [op for item in program.ranks[rank] if isinstance(item, Batch) for op in item.ops]
    return " ".join(str(op) for op in ops if op.kind.startswith(prefix))


def test_interleaved_messages_are_posted_in_the_same_order_on_both_ends():
    """Two ranks: each sends everything to the other. Written out by hand from the compute
    order above: each forward of stage 0 or 2 on rank 0 sends metadata and activations, each
    backward of stage 2 a gradient (stage 0 sends none); rank 1 receives them in that order."""
    program = lower(interleaved_1f1b(2, 4, 2))
    assert _posted(program, 0, "SEND") == (
        "0SEND_F_META0 0SEND_F0 0SEND_F_META1 0SEND_F1 2SEND_F_META0 2SEND_F0 2SEND_F_META1 "
        "2SEND_F1 0SEND_F_META2 0SEND_F2 2SEND_B0 0SEND_F_META3 0SEND_F3 2SEND_B1 2SEND_F_META2 "
        "2SEND_F2 2SEND_F_META3 2SEND_F3 2SEND_B2 2SEND_B3"
    )
    assert _posted(program, 1, "RECV") == (
        "1RECV_F_META0 1RECV_F0 1RECV_F_META1 1RECV_F1 3RECV_F_META0 3RECV_F0 3RECV_F_META1 "
        "3RECV_F1 1RECV_F_META2 1RECV_F2 1RECV_B0 1RECV_F_META3 1RECV_F3 1RECV_B1 3RECV_F_META2 "
        "3RECV_F2 3RECV_F_META3 3RECV_F3 1RECV_B2 1RECV_B3"
    )
    # rank 1 -> rank 0: stage 1's forwards, the backwards of stage 3 (to 2) and of stage 1 (to 0)
    assert _posted(program, 1, "SEND") == (
        "1SEND_F_META0 1SEND_F0 1SEND_F_META1 1SEND_F1 3SEND_B0 3SEND_B1 1SEND_F_META2 1SEND_F2 "
        "1SEND_B0 1SEND_F_META3 1SEND_F3 1SEND_B1 3SEND_B2 3SEND_B3 1SEND_B2 1SEND_B3"
    )
    assert _posted(program, 0, "RECV") == (
        "2RECV_F_META0 2RECV_F0 2RECV_F_META1 2RECV_F1 2RECV_B0 2RECV_B1 2RECV_F_META2 2RECV_F2 "
        "0RECV_B0 2RECV_F_META3 2RECV_F3 0RECV_B1 2RECV_B2 2RECV_B3 0RECV_B2 0RECV_B3"
    )


def test_activations_are_received_after_their_metadata():
    for schedule in (gpipe(3, 5), one_f_one_b(4, 6), interleaved_1f1b(2, 4, 3)):
        for items in lower(schedule).ranks:
            seen = set()
            for item in items:
                if isinstance(item, Batch):
                    for op in item.ops:
                        if op.kind == "RECV_F":
                            assert (op.stage, op.microbatch) in seen
                    seen |= {(o.stage, o.microbatch) for o in item.ops if o.kind == "RECV_F_META"}


def _edited(program, rank: int, edit):
    """``program`` with rank ``rank``'s batches' operations passed through ``edit`` (a list of
    printed actions -> a new list); emptied batches are dropped."""
    items = []
    for item in program.ranks[rank]:
        if isinstance(item, Batch):
            ops = tuple(Action.parse(a) for a in edit([str(o) for o in item.ops]))
            if ops:
                items.append(Batch(ops))
        else:
            items.append(item)
    ranks = list(program.ranks)
    ranks[rank] = tuple(items)
    return type(program)(program.schedule, tuple(ranks))


def _without(name):
    return lambda ops: [o for o in ops if o != name]


def _swap(a, b):
    return lambda ops: [b if o == a else a if o == b else o for o in ops]


@pytest.mark.parametrize(
    "rank,edit,match",
    [
        # a receive left out: the next one would take its bytes
        (
            1,
            _without("1RECV_F1"),
            "rank 0 -> rank 1, receiving end: message 3 should be 1RECV_F1, the program posts "
            "1RECV_F_META2",
        ),
        # metadata and activations sent the other way round in one batch
        (
            0,
            _swap("0SEND_F_META2", "0SEND_F2"),
            "sending end: message 4 should be 0SEND_F_META2, the program posts 0SEND_F2",
        ),
        # the last gradient never sent
        (
            1,
            _without("1SEND_B2"),
            "rank 1 -> rank 0, sending end: message 2 should be 1SEND_B2, "
            "the program posts nothing",
        ),
        # a receive posted twice
        (
            0,
            lambda ops: ops + ops if ops == ["0RECV_B0"] else ops,
            "message 1 should be 0RECV_B1, the program posts 0RECV_B0",
        ),
    ],
)
def test_validate_rejects_a_lowering_whose_messages_do_not_match(monkeypatch, rank, edit, match):
    """validate() checks the program that lowering made, not only the schedule: fed a lowered
    1F1B (2 stages, 3 microbatches) with one end of a channel broken, it names the message."""
    schedule = one_f_one_b(2, 3)
    broken = _edited(lower(schedule), rank, edit)
    assert broken != lower(schedule)
    monkeypatch.setattr(
        importlib.import_module("parallax.pipeline.validate"), "lower", lambda s: broken
    )
    with pytest.raises(ValueError, match=re.escape(match)):
        validate(schedule)


def test_two_facing_stages_exchange_between_the_same_computations():
    program = lower(one_f_one_b(2, 4))
    rank0 = " ".join(str(item) for item in program.ranks[0])
    rank1 = " ".join(str(item) for item in program.ranks[1])
    # steady state: rank 0 sends F2 and receives B1 while rank 1 receives F2 and sends B1
    assert "0F2 [0SEND_F_META2 0SEND_F2] [0RECV_B1] 0B1" in rank0
    assert "[1RECV_F_META2] [1RECV_F2 1SEND_B1] 1F2" in rank1


def _merged(program):
    """The batching before one-pair batches: consecutive batches merged (an activation receive
    still waits for the batch after its metadata)."""
    ranks = []
    for items in program.ranks:
        out = []
        for item in items:
            if isinstance(item, Batch) and out and isinstance(out[-1], Batch):
                metas = {(o.stage, o.microbatch) for o in out[-1].ops if o.kind == "RECV_F_META"}
                if not any(
                    o.kind == "RECV_F" and (o.stage, o.microbatch) in metas for o in item.ops
                ):
                    out[-1] = Batch(out[-1].ops + item.ops)
                    continue
            out.append(item)
        ranks.append(tuple(out))
    return type(program)(program.schedule, tuple(ranks))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 8, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2)])
def test_batches_are_single_pairs_per_peer_where_nccl_needs_it(p, m, v):
    """NCCL runs the k-th send and k-th receive with one peer as a pair, pairs in order: a batch
    with two sends and a receive to one peer can deadlock (interleaved 1F1B on 2 GPUs did)."""
    from parallax.pipeline.validate import _check_rounds

    program = lower(interleaved_1f1b(p, m, v))
    _check_rounds(program)
    for items in program.ranks:
        for item in items:
            if not isinstance(item, Batch):
                continue
            sends, recvs = {}, {}
            for op in item.ops:
                (src, dst), _ = comm_messages(op, program.schedule)
                if op.kind.startswith("SEND"):
                    sends[dst] = sends.get(dst, 0) + 1
                else:
                    recvs[src] = recvs.get(src, 0) + 1
            for peer in set(sends) & set(recvs):
                assert sends[peer] == recvs[peer] == 1, item
    if p == 2:  # the old, merged batching deadlocks there, and the check says where
        with pytest.raises(ValueError, match="deadlock under NCCL's send/receive pairing"):
            _check_rounds(_merged(program))


def test_a_deadlocked_program_is_reported_per_rank():
    schedule = one_f_one_b(2, 2)
    program = lower(schedule)
    rank1 = list(program.ranks[1])
    assert str(rank1[-1]) == "[1SEND_B1]"
    # rank 1 now sends its last gradient first: it waits for rank 0, which waits for rank 1
    broken = type(program)(schedule, (program.ranks[0], tuple([rank1[-1]] + rank1[:-1])))
    with pytest.raises(DeadlockError, match=r"rank 1: ...  >> \[1SEND_B1\]"):
        simulate(broken)
