"""Layout-free optimizer state: save at one dp x tp, load at another, continue, match one
uninterrupted single-process run; the streaming forms hold one full tensor at a time."""

import json
import weakref

import pytest
import torch
from torch.testing import assert_close

import parallax
from parallax.optim import ZeroOptimizer
from parallax.testing import context, run_ranks
from tests.optim.common import (
    build,
    groups,
    logical_weights,
    make_zero,
    train_reference,
    train_zero,
)

BEFORE, AFTER, ACCUM, CLIP = 3, 2, 2, 0.5
TOL = dict(rtol=1e-6, atol=1e-7)  # as in test_zero: dp averaging differs in the last bits


def _stream_one_at_a_time(items):
    """Consume ``(key, tensor)`` pairs, checking the producer keeps none of them alive (tensors
    are freed by reference counting, so a dead weak reference means nobody holds it)."""
    out, last = {}, None
    for key, value in items:
        assert last is None or last() is None, "the previous tensor is still held"
        out[key] = value.clone()
        last = weakref.ref(value)
        del value
    return out


def _save(tp: int) -> dict | None:
    ctx = context(tp=tp)
    model, opt = make_zero(ctx, "adamw", sp=tp > 1, backward_passes_per_step=ACCUM)
    train_zero(model, opt, ctx, BEFORE, ACCUM, CLIP)
    meta = opt.state_meta()
    streamed = _stream_one_at_a_time(opt.state_tensors())
    state = opt.state_dict()
    assert state["meta"] == meta == json.loads(json.dumps(meta))  # JSON as it is
    assert list(streamed) == list(state["tensors"])
    for key, value in streamed.items():
        assert torch.equal(value.cpu(), state["tensors"][key]), key
    assert meta["keys"]["fc1.weight"] == ["master", "exp_avg", "exp_avg_sq", "step"]
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]
    return state if ctx.rank == 0 else None


def _resume(tp: int, state: dict) -> None:
    ctx = context(tp=tp)
    model, opt = make_zero(ctx, "adamw", sp=tp > 1, backward_passes_per_step=ACCUM)
    with torch.no_grad():  # the checkpoint must bring back the weights too
        for p in opt.params:
            p.add_(0.5)
    fetched: list[weakref.ref] = []

    def get(key: str) -> torch.Tensor:  # serves a fresh tensor, as a lazy reader would
        assert all(r() is None for r in fetched), "an earlier tensor is still held"
        value = state["tensors"][key].clone()
        fetched.append(weakref.ref(value))
        return value

    opt.load_state_tensors(state["meta"], get)
    train_zero(model, opt, ctx, AFTER, ACCUM, CLIP, start=BEFORE)

    ref, ref_opt, _ = train_reference("adamw", BEFORE + AFTER, ACCUM, CLIP)
    got = logical_weights(model, ctx)
    tensors = opt.state_dict()["tensors"]
    for name, p in ref.named_parameters():
        assert_close(got[name], p.detach(), **TOL, msg=name)
        for key, want in ref_opt.state.get(p, {}).items():
            assert_close(tensors[f"{name}.{key}"], want.float(), **TOL, msg=f"{name}.{key}")
    assert tensors["tower.weight.step"].item() == 2  # only steps 1 and 3 gave it a gradient


def test_save_dp4_load_dp2():
    state = run_ranks(_save, 4, 1)[0]
    run_ranks(_resume, 2, 1, state)


def _resume_both(state: dict) -> None:
    _resume(1, state)  # dp=4
    _resume(2, state)  # dp=2 x tp=2, sequence parallel


def test_save_dp2_load_dp4_and_tp2():
    state = run_ranks(_save, 2, 1)[0]
    run_ranks(_resume_both, 4, state)


def test_load_errors():
    ctx = parallax.ParallelContext.local()
    model, opt = make_zero(ctx, "adamw")
    train_zero(model, opt, ctx, 1, 1, None)
    state = opt.state_dict()
    meta, tensors = state["meta"], state["tensors"]
    with pytest.raises(ValueError, match="no tensor 'fc1.weight.exp_avg'"):
        opt.load_state_tensors(
            meta, {k: v for k, v in tensors.items() if k != "fc1.weight.exp_avg"}.__getitem__
        )
    bad = {**tensors, "fc1.weight.master": torch.zeros(3, 8)}
    with pytest.raises(ValueError, match=r"shape \(3, 8\), expected the logical shape \(16, 8\)"):
        opt.load_state_dict({"meta": meta, "tensors": bad})
    with pytest.raises(ValueError, match="no state for 1 of"):
        keys = {k: v for k, v in meta["keys"].items() if k != "head.bias"}
        opt.load_state_dict({"meta": {**meta, "keys": keys}, "tensors": tensors})
    other = ZeroOptimizer(build().named_parameters(), torch.optim.AdamW, ctx)  # one group
    with pytest.raises(ValueError, match="1 param groups, this optimizer 2"):
        opt.load_state_dict(other.state_dict())
    opt.load_state_dict(state)  # and the untouched state still loads
    assert torch.equal(
        opt.state_dict()["tensors"]["fc1.weight.exp_avg"], tensors["fc1.weight.exp_avg"]
    )


def test_unnamed_parameters_use_positions():
    ctx = parallax.ParallelContext.local()
    opt = ZeroOptimizer(groups(build(), named=False), torch.optim.SGD, ctx, lr=0.1, momentum=0.9)
    assert opt.names[0] == "1"  # position 0 (frozen.weight) is not trainable
    assert opt.state_meta()["keys"]["1"] == ["master"]  # no momentum before the first step


def test_lr_scheduler_keeps_steering_after_load():
    """load_state_dict replaces the wrapped optimizer's groups; a scheduler built before must
    still set the lr the wrapped optimizer steps with (it once kept steering stale groups)."""
    import torch

    from parallax import ParallelContext
    from parallax.optim import ZeroOptimizer

    model = torch.nn.Linear(3, 2)
    ctx = ParallelContext.local()
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    opt2 = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx, lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 0.5**step)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.inner.param_groups[0]["lr"] == 0.5
    sched2.step()
    assert opt2.param_groups is opt2.inner.param_groups
    assert opt2.inner.param_groups[0]["lr"] == 0.25


def test_a_loaded_state_keeps_this_runs_kernel_options():
    """A state saved by a plain (foreach) optimizer, loaded into an offloaded one, leaves the
    host on its fused kernel: the checkpoint says what was learned, not how this run steps (an
    offloaded resume once fell back to torch's slowest per-tensor AdamW)."""
    ctx = parallax.ParallelContext.local()
    model, plain = make_zero(ctx, "adamw", stage=2, foreach=True)
    train_zero(model, plain, ctx, 1, 1, None)
    _, hosted = make_zero(ctx, "adamw", stage=2, offload=True)
    kernel = {k: hosted.inner.param_groups[0].get(k) for k in ("fused", "foreach")}
    hosted.load_state_dict(plain.state_dict())
    for g in hosted.inner.param_groups:
        assert {k: g.get(k) for k in kernel} == kernel
    assert plain.state_meta()["param_groups"][0]["foreach"] is True
