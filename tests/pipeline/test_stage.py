"""PipelineStage alone: one microbatch forward and backward, and freeing sent outputs safely."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.pipeline import PipelineStage
from parallax.testing import context, run_ranks


class Two(nn.Module):
    """Returns (a, b) with b computed from a: a's value is still needed by b's backward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a = self.lin(x) + 1.0
        if self.kind == "tanh":  # the output is saved by its own autograd node
            return torch.tanh(self.lin(x))
        if self.kind == "pair":
            return a, a * self.lin.weight.sum()
        return a


def _run(kind: str, free: bool):
    torch.manual_seed(0)
    stage = PipelineStage(Two(kind), 1, 3, ParallelContext.local())
    x = torch.randn(2, 4, requires_grad=True)
    outputs = stage.forward(0, (x,))
    grads = [torch.full_like(o, 0.5) for o in outputs]
    if free:
        stage.free_outputs(0)
    sizes = [o.numel() for o in outputs]
    (gx,) = stage.backward(0, grads)
    return sizes, gx, [p.grad.clone() for p in stage.module.parameters()]


@pytest.mark.parametrize("kind,kept", [("plain", []), ("tanh", []), ("pair", [0])])
def test_freeing_sent_outputs_keeps_gradients_exact(kind, kept):
    sizes, gx, grads = _run(kind, free=True)
    ref_sizes, ref_gx, ref_grads = _run(kind, free=False)
    assert [i for i, (a, b) in enumerate(zip(sizes, ref_sizes)) if a == b] == kept
    assert_close(gx, ref_gx)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r)


def test_inputs_without_gradient_pass_through_and_last_stage_scales_the_loss():
    stage = PipelineStage(nn.Linear(3, 1), 1, 2, ParallelContext.local())
    x = torch.randn(5, 3, requires_grad=True)
    (loss,) = stage.forward(0, (x,), torch.zeros(5, 1), nn.functional.mse_loss, loss_scale=0.25)
    (gx,) = stage.backward(0)
    unscaled = nn.functional.mse_loss(stage.module(x), torch.zeros(5, 1))
    assert_close(loss, unscaled.detach() * 0.25)
    assert_close(gx, torch.autograd.grad(unscaled * 0.25, x)[0])
    ids = torch.arange(4)
    stage = PipelineStage(nn.Embedding(4, 2), 1, 3, ParallelContext.local())
    out = stage.forward(0, (ids,))
    assert stage.backward(0, [torch.ones_like(o) for o in out]) == ()  # nothing to send back


def test_stage_errors_are_clear():
    ctx = ParallelContext.local()
    with pytest.raises(ValueError, match="stage_index 3 outside"):
        PipelineStage(nn.Linear(1, 1), 3, 3, ctx)
    stage = PipelineStage(nn.Linear(2, 2), 0, 2, ctx)
    stage.forward(0, torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="ran twice"):
        stage.forward(0, torch.ones(1, 2))
    last = PipelineStage(nn.Linear(2, 2), 1, 2, ctx)
    with pytest.raises(ValueError, match="scalar"):
        last.forward(0, (torch.ones(1, 2),), torch.ones(1, 2), lambda out, t: out)
    odd = PipelineStage(nn.Identity(), 0, 2, ctx)
    odd.module.forward = lambda x: "text"
    with pytest.raises(ValueError, match="tensor or a tuple of tensors"):
        odd.forward(0, torch.ones(1))


def _stage_count_must_divide_pp():
    try:
        PipelineStage(nn.Linear(1, 1), 0, 3, context(pp=2))
    except ValueError as err:
        return str(err)
    return None


def test_stage_count_not_matching_pp_fails_on_every_rank():
    for message in run_ranks(_stage_count_must_divide_pp, 2):
        assert "3 stages cannot be spread over pp=2 ranks" in message
