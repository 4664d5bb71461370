"""A wrong pipeline configuration fails with the same clear error on every rank, not a hang."""

import torch

from parallax import init_parameters
from parallax.pipeline import (
    build_stages,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    run_schedule,
)
from parallax.testing import context, run_ranks
from tests.pipeline import toy


def _stages(ctx, chunks=1):
    stages = build_stages(lambda i: toy.make_block(i, ctx), toy.NUM_BLOCKS, ctx, chunks)
    for stage in stages:
        init_parameters(stage.module, toy.SEED)
    return stages


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _mismatches(pp: int):
    ctx = context(pp=pp)
    inputs, targets = toy.microbatches(4)
    plain, interleaved = _stages(ctx), _stages(ctx, 2)
    rank = ctx.pp_rank
    errors = {
        "too few for 1F1B": _error(lambda: one_f_one_b(pp, pp - 1)),
        "wrong pp": _error(
            lambda: run_schedule(one_f_one_b(2 * pp, 8), plain, ctx, inputs, targets, toy.loss_fn)
        ),
        "stage count": _error(
            lambda: run_schedule(one_f_one_b(pp, 4), interleaved, ctx, inputs, targets, toy.loss_fn)
        ),
        # only the first stage sees too few microbatches; the others must not hang
        "short inputs": _error(
            lambda: run_schedule(gpipe(pp, 4), plain, ctx, inputs[:3], targets, toy.loss_fn)
        ),
        "different schedules": _error(
            lambda: run_schedule(
                gpipe(pp, 4) if rank == 0 else one_f_one_b(pp, 4),
                plain,
                ctx,
                inputs,
                targets,
                toy.loss_fn,
            )
        ),
        "interleaved needs a multiple": _error(lambda: interleaved_1f1b(pp, pp + 1, 2)),
    }
    # the pipeline still works afterwards: nothing was left half-sent
    run_schedule(one_f_one_b(pp, 4), plain, ctx, inputs, targets, toy.loss_fn)
    return errors


def _check(all_errors, pp):
    expected = {
        "too few for 1F1B": f"{pp - 1} microbatches cannot fill {pp} stages",
        "wrong pp": f"is for {2 * pp} pipeline ranks but this run has pp={pp}",
        "stage count": f"was built for {2 * pp} stages but the schedule has {pp}",
        "short inputs": "pp rank 0: the first stage got 3 input microbatches for a schedule of 4",
        "different schedules": "pipeline ranks run different schedules",
        "interleaved needs a multiple": f"not a multiple of {pp} ranks",
    }
    for rank, errors in enumerate(all_errors):
        for key, text in expected.items():
            assert errors[key] is not None and text in errors[key], (rank, key, errors[key])
        assert len({e for e in errors.values()}) == len(errors)


def test_mismatches_fail_on_every_rank_pp2():
    _check(run_ranks(_mismatches, 2, 2, timeout=60), 2)


def test_mismatches_fail_on_every_rank_pp4():
    _check(run_ranks(_mismatches, 4, 4, timeout=60), 4)


def _device_tensor_over_gloo():
    from parallax import comm

    ctx = context(pp=2)
    peer = ctx.pp_peer(1 - ctx.pp_rank)
    t = torch.empty(4, device="meta")  # stands for a CUDA tensor: gloo takes CPU tensors only
    return _error(lambda: comm.post_send_recv([(t, peer)], [], ctx.pp_group))


def test_gloo_refuses_device_tensors_on_every_rank():
    for err in run_ranks(_device_tensor_over_gloo, 2):
        assert err is not None and "gloo sends and receives CPU tensors only" in err
