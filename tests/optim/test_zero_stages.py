"""ZeroOptimizer(stage=2|3) against plain torch on tests/optim/common.py's Net (sharded,
replicated, sequence-parallel, frozen, unused and sometimes-used parameters), and what the
stages hold: no gradient buffer, pass buffers of a bucket or two, weights sharded over dp."""

import functools
import time

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from parallax.optim import ZeroOptimizer
from parallax.optim.zero.reduction.pass_reducer import IN_FLIGHT
from parallax.tensor import unshard_tensor
from parallax.testing import context, run_ranks
from tests.optim.common import OPTIMIZERS, batch, build, groups, local_rows

STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)

# (optimizer, stage, accumulation, clip, sequence parallel, tower on every row, share of the
# optimizer offloaded[, share of that summed on the device[, modes: "defer" the host's step under
# the next forward, "one-pass" its AdamW (--host-adamw)]]). At stage 3 every dp rank must run
# the same modules: the tower (used by one dp rank's rows only on odd steps) then runs on all
# rows.
CASES = {
    2: [
        ("adamw", 2, 2, 0.5, False, False, 0.0),
        ("adamw-fused", 2, 1, 0.5, False, False, 0.0),
        ("adamw", 3, 2, 0.5, False, True, 0.0),
        ("sgd", 3, 1, None, False, True, 0.0),
        ("adamw", 2, 2, 0.5, False, False, 0.5),  # half on the host, stepped after the clip
        ("adamw", 3, 2, None, False, True, 0.5),  # ... stepped during the backward
        ("adamw", 2, 3, 0.5, False, False, 0.5, 1.0, "one-pass"),  # every sum on the device
        ("adamw", 2, 3, 0.5, False, False, 1.0, 0.6),  # some sums kept on the device, clipped
        ("adamw", 3, 3, None, False, True, 1.0, 0.6),  # ... stepped during the backward
        ("adamw", 3, 3, None, False, True, 1.0),  # (the last one's twin, every sum on the host)
        ("adamw", 3, 2, 0.5, False, True, 1.0, 0.0, "defer"),  # the step under the next forward
        ("adamw", 3, 2, 0.5, False, True, 1.0),  # (its twin, waited for in step())
        ("adamw", 2, 3, 0.5, False, False, 1.0, 0.6, "one-pass"),  # in place and out
        ("adamw", 3, 2, 0.5, False, True, 1.0, 0.0, "defer one-pass"),
    ],
    "2x2": [
        ("adamw", 2, 2, 0.5, True, False, 0.0),
        ("adamw", 3, 2, 0.5, True, True, 0.0),
        ("adamw", 3, 2, 0.5, True, True, 1.0),
    ],
}


def _batch(step: int, micro: int, always: bool):
    x, y, use = batch(step, micro)
    return x, y, torch.ones_like(use) if always else use


def _reference(name, accum, clip, always):
    cls, kwargs = OPTIMIZERS[name]
    model = build()
    opt = cls(groups(model, named=False), **kwargs)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            x, y, use = _batch(step, micro, always)
            (F.mse_loss(model(x, use), y) / accum).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def _zero(ctx, name, stage, accum, clip, sp, always, offload=0.0, on_gpu=0.0, mode="") -> dict:
    """``offload``: the share of the optimizer offloaded (0: none); ``on_gpu``: the share of
    that whose gradients are summed on the device; ``mode``: "defer" leaves the host's step
    running under the next forward, "one-pass" steps it with the one-pass AdamW."""
    cls, kwargs = OPTIMIZERS[name]
    model = build(ctx, sp).to(ctx.device)
    opt = ZeroOptimizer(
        groups(model),
        cls,
        ctx,
        stage=stage,
        modules=[model],
        bucket_numel=100,  # several buckets even for this tiny model
        param_order=model.parameters(),  # buckets go out in the backward's order
        backward_passes_per_step=accum,
        offload=offload > 0,
        offload_fraction=offload or 1.0,
        gpu_accumulation=on_gpu,
        step_in_backward=offload > 0 and clip is None,
        host_adamw="one-pass" if "one-pass" in mode else "torch",
        **kwargs,
    )
    if "one-pass" in mode:
        assert opt.host.one_pass is not None
    if "defer" in mode:
        assert opt.overlap_host_step(model)
        stepper = opt.host.one_pass or opt.host.inner
        inner_step = stepper.step  # a slow host, its pieces' .grad set: the main
        # thread's step and the next forward run while the worker steps (a race there once
        # took the worker's gradients away, or stepped host pieces twice)

        def slow(*args, **kwargs):
            time.sleep(0.02)
            return inner_step(*args, **kwargs)

        stepper.step = slow
    norms, grads_left = [], 0
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            x, y, use = (local_rows(t, ctx).to(ctx.device) for t in _batch(step, micro, always))
            (F.mse_loss(model(x, use), y) / accum).backward()
            grads_left += sum(p.grad is not None for p in model.parameters())
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
    weights = {}
    for n, p in model.named_parameters():
        local, info = opt.weight(p), getattr(p, "tp_shard", None)
        weights[n] = local if info is None else unshard_tensor(local, info, ctx.tp_group)
    report = opt.memory_report()
    buckets = [b.numel for b in opt.layout.buckets]
    return dict(
        weights=weights,
        norms=norms,
        grads_left=grads_left,
        grad_buffers=len(opt.flat.grad_buffers) + report.grad_bytes,
        pass_peak=report.pass_peak_bytes,
        largest_bucket=max(buckets),
        held=sum(b.numel for b in opt.layout.buckets if b.sequence_parallel),
        numel=sum(buckets),
        weight_bytes=report.param_bytes + report.frozen_bytes,
        model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        gathered_now=report.gathered_bytes,
        late=opt.reducer.late,
        host_bytes=report.host_bytes,
        kept_bytes=report.kept_bytes,
        host_phases=sorted(k for k, v in opt.host.seconds.items() if v > 0) if opt.host else [],
        forward_waits=opt.host.seconds["wait_bucket"] if opt.host else 0.0,
    )


def _cases(tp: int, cases: list) -> list[dict]:
    ctx = context(tp=tp)
    return [_zero(ctx, *case) for case in cases]


@functools.cache
def _results(layout) -> list:
    """Every rank's results of ``CASES[layout]``, run once for the tests that read them."""
    tp, world = (2, 4) if layout == "2x2" else (1, layout)
    return run_ranks(_cases, world, tp, CASES[layout])


@pytest.mark.parametrize("layout", [2, "2x2"])
def test_stages_2_and_3_match_torch(layout):
    """Weights and clip norms after several steps with accumulation equal plain torch's; the
    stages keep no gradient buffer (``.grad`` is None after every backward) and reduce into
    pass buffers of at most a few buckets; stage 3 holds about 1/dp of the weights."""
    tp, world = (2, 4) if layout == "2x2" else (1, layout)
    results = _results(layout)
    dp = world // tp
    for k, (name, stage, accum, clip, sp, always, offload, *more) in enumerate(CASES[layout]):
        ref_weights, ref_norms = _reference(name, accum, clip, always)
        case = f"{name} stage={stage} accum={accum} clip={clip} sp={sp} offload={offload} {more}"
        on_gpu = more[0] if more else 0.0
        for rank in results:
            got = rank[k]
            assert_close(torch.tensor(got["norms"]), torch.tensor(ref_norms), **TOL, msg=case)
            for n, want in ref_weights.items():
                assert_close(got["weights"][n].float(), want, **TOL, msg=f"{case}: {n}")
            assert got["grads_left"] == 0 and got["grad_buffers"] == 0, case
            assert got["late"] == 0  # every pass was reduced when its backward ended
            # pass buffers (fp32, the bucket and a reduce-scatter output of bucket/dp) of the
            # buckets in flight, and the sequence-parallel ones, which wait for the end of the
            # pass: a few buckets, never the model's gradient
            per_bucket = 4 * got["largest_bucket"] * (1 + 1 / dp)
            bound = (IN_FLIGHT + 1) * per_bucket + 4 * got["held"] * (1 + 1 / dp)
            assert got["pass_peak"] <= bound, case
            assert (got["host_bytes"] > 0) == (offload > 0), case
            assert (got["kept_bytes"] > 0) == bool(on_gpu), case
            if offload:  # where the host's time went, by phase
                later = ["step_later", "wait"] if clip is not None else []
                assert set(got["host_phases"]) >= {"finish", "upload", *later}, case
            if stage == 3:
                assert got["gathered_now"] == 0, case
                # this rank's shard of every weight (frozen ones too), padding aside
                assert got["weight_bytes"] <= got["model_bytes"] / dp + 64 * 4 * 16, case


def test_sums_kept_on_the_device_step_as_the_host_sums():
    """Stepped during the backward (no norm involved), the sums kept on the device give the
    same weights, bit for bit, as the same sums made in host memory: the same fp32 additions,
    rounded to the model's dtype the same way. (On the CPU "the device" is host memory too: the
    test runs the kept buckets' code path, its GPU streams aside.) And the host holds less."""
    for rank in _results(2):
        kept, hosted = rank[-6:-4]
        for n, w in hosted["weights"].items():
            assert torch.equal(kept["weights"][n], w), n
        assert kept["host_bytes"] < hosted["host_bytes"]


def test_the_host_step_under_the_next_forward_changes_nothing():
    """Left running under the next forward (each block waiting for its own weights, ZeRO-3's
    gathers here), the host's step gives the weights and norms of the same step waited for in
    ``step()``, bit for bit, and the forward did wait for it."""
    deferred, waited = _results(2)[0][-4:-2]
    for n, w in waited["weights"].items():
        assert torch.equal(deferred["weights"][n], w), n
    assert deferred["norms"] == waited["norms"]
    assert "wait_bucket" in deferred["host_phases"] and "wait_bucket" not in waited["host_phases"]
