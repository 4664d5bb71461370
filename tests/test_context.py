import torch

from parallax import ParallelContext, ParallelDims, comm, init_parallel
from parallax.testing import context, run_ranks


def _check_groups(tp, pp, dp):
    ctx = context(tp=tp, pp=pp, dp=dp)
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    assert ctx.dims == dims and ctx.world_size == 8
    assert (ctx.pp_rank, ctx.dp_rank, ctx.tp_rank) == dims.coords(ctx.rank)
    out = {}
    for axis in ("tp", "dp", "pp"):
        group = getattr(ctx, f"{axis}_group")
        members = comm.all_gather(torch.tensor([ctx.rank]), group)  # who is really in my group
        assert members.tolist() == getattr(ctx, f"{axis}_ranks"), axis
        assert comm.size(group) == getattr(ctx, f"{axis}_size")
        out[axis] = members.tolist()
    out["prev_next"] = (ctx.pp_prev, ctx.pp_next, ctx.is_first_stage, ctx.is_last_stage)
    return out


def test_groups_match_dims_on_8_ranks():
    for tp, pp, dp in [(2, 2, 2), (4, 2, 1), (1, 1, 8), (2, 1, 4)]:
        results = run_ranks(_check_groups, 8, tp, pp, dp)
        dims = ParallelDims(tp=tp, pp=pp, dp=dp)
        for rank, res in enumerate(results):
            assert any(res["tp"] == g for g in dims.tp_groups())
            p, d, t = dims.coords(rank)
            prev, nxt, first, last = res["prev_next"]
            assert prev == dims.rank((p - 1) % pp, d, t) and nxt == dims.rank((p + 1) % pp, d, t)
            assert first == (p == 0) and last == (p == pp - 1)


def _bad_layout(tp, pp, dp):
    try:
        init_parallel(tp=tp, pp=pp, dp=dp)
    except ValueError as err:
        return str(err)
    return None


def test_bad_layout_fails_on_every_rank_without_hanging():
    messages = run_ranks(_bad_layout, 8, 3, 1, None, timeout=30)
    assert all(m and "world size 8 is not divisible by tp*pp = 3*1" in m for m in messages)
    messages = run_ranks(_bad_layout, 8, 2, 2, 4, timeout=30)
    assert all(m and "16 ranks does not match world size 8" in m for m in messages)


def test_dp_is_inferred():
    sizes = run_ranks(_infer_dp, 4)
    assert sizes == [(2, 1, 2)] * 4


def _infer_dp():
    ctx = context(tp=2)
    return ctx.tp_size, ctx.pp_size, ctx.dp_size


def test_local_context_without_process_group():
    ctx = ParallelContext.local()
    assert ctx.world_size == 1 and ctx.tp_group is None and ctx.is_first_stage and ctx.is_last_stage
    x = torch.ones(3)
    assert comm.all_reduce(x, ctx.tp_group) is x


def _problems_on_rank_2():
    ctx = context(tp=2)
    assert ctx.agreement_group is ctx.host_group is not None  # the world, under gloo
    return (
        comm.problems("bad input" if ctx.rank == 2 else None, ctx.agreement_group),
        comm.problems(None, ctx.agreement_group),
    )


def test_one_ranks_problem_reaches_every_rank():
    for found, none in run_ranks(_problems_on_rank_2, 4, timeout=30):
        assert found == ["rank 2: bad input"] and none == []
    assert comm.problems("alone", None) == ["alone"]


def test_shutdown_meets_the_peers_only_on_a_clean_gloo_ending(monkeypatch):
    """A clean ending waits at a barrier before tearing gloo down (a peer's threads still
    reading a closed socket aborted it); an ending on an error leaves at once."""
    import parallax.context as pc

    calls = []
    monkeypatch.setattr(pc.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(pc.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(pc.dist, "monitored_barrier", lambda timeout: calls.append("barrier"))
    monkeypatch.setattr(pc.dist, "destroy_process_group", lambda: calls.append("destroy"))
    for backend, clean, expected in [
        ("gloo", True, ["barrier", "destroy"]),
        ("gloo", False, ["destroy"]),
        ("nccl", True, ["destroy"]),
    ]:
        calls.clear()
        monkeypatch.setattr(pc.dist, "get_backend", lambda b=backend: b)
        pc.shutdown(clean)
        assert calls == expected, (backend, clean, calls)
