"""``--host-adamw one-pass`` (:mod:`parallax.optim.zero.offload.host_adamw`) steps as torch's
AdamW does: three steps from the same start on the same bf16 gradients, two parameter groups (one
without weight decay), the dp average and a clip coefficient folded in, in place and into a
separate buffer; fp32 rounding apart (its scalars and order differ). And it hands its compiled
kernel what it was compiled for: plain tensors, never a Parameter or a view (either made the
compiler build anew in the worker for each piece's size), on examples covering each offset."""

import pytest
import torch
from torch.testing import assert_close

from parallax.optim import ZeroOptimizer
from parallax.optim.zero.offload.host_adamw import EXAMPLE, HostAdamW, examples, supports
from parallax.testing import context


def test_it_steps_as_torchs_adamw():
    torch.manual_seed(0)
    start = [torch.randn(301), torch.randn(64)]
    ref = [p.clone().requires_grad_() for p in start]
    mine = [p.clone().requires_grad_() for p in start]
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    torch_opt = torch.optim.AdamW([{"params": ref[:1], "weight_decay": 0.1},
                                   {"params": ref[1:], "weight_decay": 0.0}], **hyper)  # fmt: skip
    inner = torch.optim.AdamW([{"params": mine[:1], "weight_decay": 0.1},
                               {"params": mine[1:], "weight_decay": 0.0}], **hyper)  # fmt: skip
    assert supports(type(inner), inner.param_groups)
    assert not supports(torch.optim.AdamW, [{"lr": 1e-3}, {"amsgrad": True}])
    assert not supports(torch.optim.Adam, inner.param_groups)
    kernel = HostAdamW(compiled=False)
    scale = 0.5 * 0.7  # the dp average of 2 ranks and a clip coefficient
    for _ in range(3):
        grads = [torch.randn_like(p).bfloat16() for p in start]
        for p, g in zip(ref, grads):
            p.grad = g.float() * scale
        torch_opt.step()
        out = torch.empty(64, dtype=torch.bfloat16)
        in_place = grads[0].clone()
        with torch.no_grad():
            kernel.step(inner, [(mine[0], in_place, None, 0), (mine[1], grads[1], out, 1)], scale)
        for a, b in zip(mine, ref):
            assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(in_place, mine[0].detach().bfloat16())  # the new weights, in place
        assert torch.equal(out, mine[1].detach().bfloat16())
    for a, b in zip(mine, ref):
        ours, theirs = inner.state[a], torch_opt.state[b]
        assert float(ours["step"]) == float(theirs["step"]) == 3
        assert_close(ours["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_the_kernel_gets_plain_tensors_over_the_pieces_memory():
    seen = []

    def kernel(*args):
        seen.append(args[:-1])  # (the scalars aside)

    masters = [torch.nn.Parameter(torch.zeros(10)[2:7]), torch.nn.Parameter(torch.zeros(3))]
    inner = torch.optim.AdamW(masters, lr=1e-3)
    step = HostAdamW(compiled=False)
    step.in_place = step.out = kernel
    grads = torch.ones(12, dtype=torch.bfloat16)
    out = torch.empty(12, dtype=torch.bfloat16)
    pieces = [(masters[0], grads[4:9], None, 0), (masters[1], grads[9:12], out[9:12], 0)]
    step.step(inner, pieces, 1.0)
    assert len(seen) == 2
    for args, (master, grad, dest, _) in zip(seen, pieces):
        for t in args:
            assert type(t) is torch.Tensor and t._base is None, type(t)
        g, p = args[:2]
        assert g.data_ptr() == grad.data_ptr() and p.data_ptr() == master.data_ptr()
        if dest is not None:
            assert args[-1].data_ptr() == dest.data_ptr()


@pytest.mark.parametrize("out", [None, torch.bfloat16])
def test_the_examples_cover_each_offset_at_a_size_that_runs_in_parallel(out):
    got = list(examples(torch.bfloat16, out))
    views = 2 if out is None else 3
    assert len(got) == 2**views
    patterns = set()
    for g, p, m, v, o in got:
        tensors = [g, p] + ([o] if out is not None else [])
        assert all(t.numel() == EXAMPLE and t._base is None for t in [*tensors, m, v])
        assert g.dtype == torch.bfloat16 and p.dtype == m.dtype == v.dtype == torch.float32
        offsets = [t.storage_offset() for t in tensors]
        patterns.add(tuple(k == 0 for k in offsets))
        nonzero = [k for k in offsets if k]
        assert len(set(nonzero)) == len(nonzero) and all(k >= 2 for k in nonzero)
    assert len(patterns) == 2**views  # offset 0 and another, for each view


def test_the_option_is_checked_before_any_collective(monkeypatch):
    def collective(*args, **kwargs):
        raise AssertionError("checked too late: the arguments' agreement is a collective")

    monkeypatch.setattr("parallax.optim.zero.optimizer.accept", collective)
    ctx = context()
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="host_adamw must be one of"):
        ZeroOptimizer(params, torch.optim.AdamW, ctx, stage=2, offload=True, host_adamw="fast")
    with pytest.raises(ValueError, match="one-pass.*amsgrad"):
        ZeroOptimizer(params, torch.optim.AdamW, ctx, stage=2, offload=True,
                      host_adamw="one-pass", amsgrad=True)  # fmt: skip
    with pytest.raises(ValueError, match="one-pass"):
        ZeroOptimizer(params, torch.optim.SGD, ctx, stage=2, offload=True,
                      host_adamw="one-pass", lr=0.1)  # fmt: skip


@pytest.mark.parametrize("out", [False, True])
def test_a_split_master_steps_as_the_whole_one(out):
    """Held as its bf16 weight and low half (--host-masters split), a master steps to the
    whole one's values (but where a tie moved it one ulp), in place over the sums or into
    another buffer; its new low half and weight are written, the key tensor never read."""
    from parallax.optim.zero.buffers.master_halves import join, low_half

    torch.manual_seed(1)
    start = torch.randn(1000)
    whole = start.clone().requires_grad_()
    key = torch.full((1000,), float("nan"), requires_grad=True)  # (its state's key alone)
    weight, low = start.bfloat16(), low_half(start)
    start = join(weight, low)  # (the whole master starts where the split one reads back)
    with torch.no_grad():
        whole.copy_(start)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    a, b = torch.optim.AdamW([whole], **hyper), torch.optim.AdamW([key], **hyper)
    kernel = HostAdamW(compiled=False)
    for _ in range(3):
        sums = (torch.randn(1000) * 1e-2).to(torch.float32 if out else torch.bfloat16)
        dest = torch.empty(1000, dtype=torch.bfloat16) if out else None
        split_sums, whole_sums = sums.clone(), sums.clone()
        whole_dest = None if dest is None else torch.empty_like(dest)
        with torch.no_grad():
            kernel.step(a, [(whole, whole_sums, whole_dest, 0)], 0.5)
            kernel.step(b, [(key, split_sums, dest, 0, (weight, low))], 0.5)
        new = split_sums if dest is None else dest
        weight = new.clone()  # (the weights go up; the next step brings them down)
        assert_close(join(weight, low), whole.detach(), rtol=1e-6, atol=1e-9)
        theirs = whole_sums if whole_dest is None else whole_dest
        assert_close(weight.float(), theirs.float(), rtol=2**-7, atol=0)  # (a bf16 ulp)
    assert torch.isnan(key).all()
    assert_close(b.state[key]["exp_avg_sq"], a.state[whole]["exp_avg_sq"], rtol=1e-6, atol=0)
