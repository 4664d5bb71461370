"""Checks that one rank makes alone: every rank raises the same error, or every rank makes the
same collectives, well within a short timeout (a regression hangs and fails at the timeout)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from parallax.optim import ZeroOptimizer
from parallax.testing import context, run_ranks

TIMEOUT = 30  # seconds: far above what the tests take, far below the process groups' timeout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _device_on_one_rank(bad_rank: int, all_meta: bool) -> str | None:
    """At tp=2 x dp=2, rank ``bad_rank`` alone has a parameter (or all) on the meta device."""
    ctx = context(tp=2)
    model = _model()
    if ctx.rank == bad_rank and all_meta:
        model.to("meta")
    elif ctx.rank == bad_rank:
        model[2].bias = nn.Parameter(torch.empty(2, device="meta"))
    try:
        ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx, lr=1e-3)
    except ValueError as err:
        return str(err)
    return None


def test_a_parameter_on_the_wrong_device_on_one_rank_fails_everywhere():
    """The bad rank shares neither a dp nor a tp group with rank 0 (rank 3 of tp2 x dp2): the
    verdict still reaches every rank of the plane."""
    for msg in run_ranks(_device_on_one_rank, 4, 3, False, timeout=TIMEOUT):
        assert msg and "rank 3: parameters are on several devices ['cpu', 'meta']" in msg, msg
    for msg in run_ranks(_device_on_one_rank, 4, 1, True, timeout=TIMEOUT):
        assert msg and "rank 1: parameters are on the meta device" in msg, msg


def _bad_argument_on_one_rank() -> str | None:
    ctx = context(tp=2)
    model = _model()
    params = list(model.named_parameters())
    if ctx.rank == 2:
        params.append(params[0])  # given twice: normalize_param_groups refuses it, here only
    try:
        ZeroOptimizer(params, torch.optim.AdamW, ctx, lr=1e-3)
    except ValueError as err:
        return str(err)
    return None


def test_a_bad_argument_on_one_rank_fails_everywhere():
    for msg in run_ranks(_bad_argument_on_one_rank, 4, timeout=TIMEOUT):
        assert msg and "rank 2: parameter '0.weight' is given twice" in msg, msg


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _discard_with_backward_on_one_rank() -> list[float]:
    """dp rank 0 runs a backward (its hooks launch every bucket), rank 1 none at all; both then
    discard the step with zero_grad(). Rank 1 must make the collectives rank 0 launched, or
    the next step's reduce-scatters pair up wrongly (or hang); the next step must equal one
    process's step."""
    ctx = context()
    model = _model()
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.SGD, ctx, lr=0.1, bucket_numel=8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    opt.zero_grad()
    if ctx.dp_rank == 0:
        F.mse_loss(model(x * 5), y).backward()
        assert opt.reducer.launched == len(opt.layout.buckets)
    opt.zero_grad()  # discard: completes what any rank launched, on every rank
    rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    _step(model, opt, x[rows], y[rows])
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def test_zero_grad_mid_step_with_a_backward_on_one_rank_only():
    ref = _model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    _step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    want = torch.tensor([v for p in ref.parameters() for v in p.detach().flatten().tolist()])
    for got in run_ranks(_discard_with_backward_on_one_rank, 2, timeout=TIMEOUT):
        assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-7)


def _unsaveable_state_on_one_rank() -> str | None:
    ctx = context(tp=2)
    model = _model()
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx, lr=1e-3)
    _step(model, opt, torch.randn(2, 4), torch.randn(2, 2))
    if ctx.rank == 3:
        piece = opt.flat.piece_params[0]
        opt.inner.state[piece]["note"] = "not a tensor"
    try:
        opt.state_meta()
    except NotImplementedError as err:
        return str(err)
    return None


def test_unsaveable_state_on_one_rank_fails_everywhere():
    for msg in run_ranks(_unsaveable_state_on_one_rank, 4, timeout=TIMEOUT):
        assert msg and "rank 3: optimizer state 'note'" in msg, msg
