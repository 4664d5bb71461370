"""Pipelined training equals the unsplit model: loss and every gradient, for every schedule.

Gloo ranks in float32, against the same 8-block model run in one process on the same global
batch. The model passes two tensors that need gradients and one integer tensor between stages,
and its sequence length changes between microbatches.
"""

import pytest
from torch.testing import assert_close

from parallax import ParallelContext, comm, init_parameters
from parallax.pipeline import (
    Timeline,
    build_stages,
    gather_events,
    gpipe,
    interleaved_1f1b,
    measured_bubble,
    merge_traces,
    one_f_one_b,
    run_schedule,
    write_chrome_trace,
)
from parallax.pipeline.timeline import read_trace
from parallax.tensor import shard_tensor
from parallax.testing import context, run_ranks
from tests.pipeline import toy

TOL = dict(rtol=1e-5, atol=1e-6)


def _schedules(pp: int, m: int):
    out = [gpipe(pp, m), one_f_one_b(pp, m), interleaved_1f1b(pp, m, 2)]
    if pp * 4 <= toy.NUM_BLOCKS:
        out.append(interleaved_1f1b(pp, m, 4))
    return out


def _train_step(ctx, schedule, m: int, timeline=None):
    """One pipelined step on this rank's replica; returns (loss, stages) with dp-averaged grads."""
    stages = build_stages(
        lambda i: toy.make_block(i, ctx), toy.NUM_BLOCKS, ctx, schedule.chunks_per_rank
    )
    for stage in stages:
        init_parameters(stage.module, toy.SEED)
    inputs, targets = toy.microbatches(m, offset=ctx.dp_rank * m)
    if not stages[0].is_first:
        inputs = None  # only the first stage reads them
    loss = run_schedule(schedule, stages, ctx, inputs, targets, toy.loss_fn, timeline=timeline)
    for stage in stages:
        assert stage.in_flight == 0, f"{stage} still holds microbatches"
        for p in stage.module.parameters():
            comm.all_reduce(p.grad, ctx.dp_group, op="avg")
    return comm.all_reduce(loss, ctx.dp_group, op="avg"), stages


def _check_against_reference(stages, loss, ref_loss, ref_grads, what: str) -> int:
    assert_close(loss.item(), ref_loss, **TOL, msg=f"{what}: loss")
    checked = 0
    for stage in stages:
        for name, p in stage.module.named_parameters():
            assert p.grad is not None, f"{what}: {name} got no gradient"
            ref = ref_grads[name]
            if hasattr(p, "tp_shard"):
                ref = shard_tensor(ref, p.tp_shard)
            assert_close(p.grad, ref, **TOL, msg=f"{what}: gradient of {name}")
            checked += 1
    return checked


def _equivalence(tp: int, pp: int, dp: int, m: int):
    ctx = context(tp=tp, pp=pp, dp=dp)
    ref_loss, ref_grads = toy.reference(m * dp)  # the whole global batch in one process
    counts = {}
    for schedule in _schedules(pp, m):
        loss, stages = _train_step(ctx, schedule, m)
        counts[schedule.name] = _check_against_reference(
            stages, loss, ref_loss, ref_grads, f"{schedule.name} tp{tp} pp{pp} dp{dp}"
        )
    return counts


def _assert_every_parameter_checked(counts_per_rank, tp: int, dp: int):
    total = len(toy.reference(1)[1])
    heads = counts_per_rank[:: tp * dp]  # tp rank 0, dp rank 0 of each pipeline rank
    for name in heads[0]:
        assert sum(c[name] for c in heads) == total, name


def test_pp1_runs_every_schedule_without_communication():
    ctx = ParallelContext.local()
    ref_loss, ref_grads = toy.reference(3)
    for schedule in (gpipe(1, 3), one_f_one_b(1, 3), interleaved_1f1b(1, 3, 4)):
        loss, stages = _train_step(ctx, schedule, 3)
        _check_against_reference(stages, loss, ref_loss, ref_grads, schedule.name)


def test_pp2_matches_single_process():
    counts = run_ranks(_equivalence, 2, 1, 2, 1, 4)
    _assert_every_parameter_checked(counts, 1, 1)


@pytest.mark.parametrize("tp,pp,dp", [(1, 4, 1), (2, 2, 1), (1, 2, 2)])
def test_world4_layouts_match_single_process(tp, pp, dp):
    counts = run_ranks(_equivalence, 4, tp, pp, dp, 4)
    _assert_every_parameter_checked(counts, tp, dp)


def _timeline(trace_dir: str):
    ctx = context(pp=2)
    timeline = Timeline()
    for _ in range(2):
        _train_step(ctx, one_f_one_b(2, 4), 4, timeline=timeline)
    write_chrome_trace(f"{trace_dir}/rank{ctx.rank}.trace.json", timeline.events)
    events = gather_events(timeline, ctx)
    if ctx.rank == 0:
        write_chrome_trace(f"{trace_dir}/all.trace.json", events)
        return events
    return None


def test_timeline_records_every_rank_and_measures_the_bubble(tmp_path):
    events = run_ranks(_timeline, 2, str(tmp_path))[0]
    computes = [e for e in events if e["cat"] == "compute"]
    assert len(computes) == 2 * 2 * 2 * 4  # steps x ranks x (F, B) x microbatches
    assert {e["name"] for e in computes if e["pid"] == 1} == {
        f"1{k}{i}" for k in "FB" for i in range(4)
    }
    assert {e["cat"] for e in events} >= {"compute", "send", "recv", "wait", "step"}
    for step in (0, 1):
        assert 0.0 < measured_bubble(events, step) < 1.0
    merged = merge_traces(
        [tmp_path / "rank0.trace.json", tmp_path / "rank1.trace.json"], tmp_path / "m.json"
    )
    trace = read_trace(tmp_path / "all.trace.json")
    assert len(read_trace(merged)) == len(trace)
    names = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (pp 0, dp 0, tp 0)", "rank 1 (pp 1, dp 0, tp 0)"}
    assert measured_bubble(trace) == pytest.approx(measured_bubble(events))


def _grads_are_accumulated_not_replaced():
    """A second step adds to .grad (the same tensor objects), as gradient accumulation and
    ZeRO hooks expect."""
    ctx = context(pp=2)
    schedule = one_f_one_b(2, 4)
    stages = build_stages(lambda i: toy.make_block(i, ctx), toy.NUM_BLOCKS, ctx)
    for stage in stages:
        init_parameters(stage.module, toy.SEED)
    inputs, targets = toy.microbatches(4)
    run_schedule(schedule, stages, ctx, inputs, targets, toy.loss_fn)
    first = {n: p.grad for n, p in stages[0].module.named_parameters()}
    snapshot = {n: g.clone() for n, g in first.items()}
    loss = run_schedule(schedule, stages, ctx, inputs, targets, toy.loss_fn, loss_scale=0.5)
    for n, p in stages[0].module.named_parameters():
        assert p.grad is first[n]
        assert_close(p.grad, snapshot[n] * 3, **TOL)  # 1/4 per microbatch, then 1/2: 3x in all
    return loss.item()


def test_gradients_accumulate_across_steps_and_loss_scale():
    losses = run_ranks(_grads_are_accumulated_not_replaced, 2)
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(2 * toy.reference(4)[0], rel=1e-5)
