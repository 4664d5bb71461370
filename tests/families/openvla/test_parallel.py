"""tp=2, tp=4 and pipeline splits against the tp=1 model from the same seed (float32, gloo).

Each rank also builds the tp=1 model in-process (it is tiny) and compares: its shard of the
logits, the loss, every gradient (gathered over tp, matched by its layout-free name), the action
metrics and greedily decoded tokens. Pipeline stages are chained by hand the way an executor
would (detached boundary, backward with the received gradient).
"""

import pytest
import torch

from parallax import ParallelContext, ParallelDims
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.predict import generate
from parallax.tensor import unshard_tensor
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import (
    SEED,
    assert_rel_close,
    greedy_margin,
    make_batch,
    perturbed_init,
    tiny_config,
)


def _model(cfg, ctx=None, **kw):
    model = OpenVLA(cfg, ctx, **kw)
    model.init_weights(SEED, perturbed_init)
    return model


def _reference(cfg, px, ids, labels):
    model = _model(cfg)
    logits = model(px, ids)
    loss = model.loss(logits, labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    tokens = generate(model, px[:1], ids[:1, :-8], 7)
    # the tokens are compared exactly at every layout: no step may be a near-tie
    assert greedy_margin(model, px[:1], ids[:1, :-8], tokens) > 1e-3
    return logits.detach(), loss.detach(), grads, model.action_metrics(logits, labels), tokens


def _check_grads(stages, ref_grads, group):
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            info = getattr(p, "tp_shard", None)
            grad = p.grad if info is None else unshard_tensor(p.grad, info, group)
            assert_rel_close(grad, ref_grads[name], msg=name)
            seen.add(name)
    assert seen == set(ref_grads)  # the stages hold exactly the whole model's parameters


def _chain(stages, px, ids, labels):
    """Forward and backward through stages as a pipeline would: boundaries detached."""
    x, outputs = (px, ids), []
    for stage in stages:
        inputs = [t.detach().requires_grad_() if t.is_floating_point() else t for t in x]
        inputs = inputs if stage.has_vision else inputs[:1]
        out = stage(*inputs)
        outputs.append((inputs, out))
        x = (out,)
    loss = stages[-1].loss(outputs[-1][1], labels)
    grad = None
    for inputs, out in reversed(outputs):
        if grad is None:
            loss.backward()
        else:
            out.backward(grad)
        grad = inputs[0].grad
    return outputs[-1][1].detach(), loss.detach()


def _check_layout(ctx, cfg, splits, checkpointing):
    px, ids, labels = make_batch(cfg)
    ref_logits, ref_loss, ref_grads, ref_metrics, ref_tokens = _reference(cfg, px, ids, labels)
    shard = ref_logits.shape[-1] // ctx.tp_size
    mine = ref_logits[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard]
    group = ctx.tp_group

    model = _model(cfg, ctx)
    logits = model(px, ids)
    assert_rel_close(logits, mine)
    loss = model.loss(logits, labels)
    assert_rel_close(loss, ref_loss)
    loss.backward()
    _check_grads([model], ref_grads, group)
    metrics = model.action_metrics(logits, labels)
    for key, value in ref_metrics.items():
        assert_rel_close(metrics[key], value, msg=key)
    for use_cache in (True, False):
        tokens = generate(model, px[:1], ids[:1, :-8], 7, use_cache=use_cache)
        assert torch.equal(tokens, ref_tokens)

    n = len(OpenVLA.stage_blocks(cfg))
    bounds = [0, *splits, n]
    stages = [
        _model(cfg, ctx, blocks=range(a, b), activation_checkpointing=checkpointing)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    logits, loss = _chain(stages, px, ids, labels)
    assert_rel_close(logits, mine)
    assert_rel_close(loss, ref_loss)
    _check_grads(stages, ref_grads, group)
    return loss.item()


def _tp_worker(tp, splits, kv_heads):
    cfg = tiny_config(num_key_value_heads=kv_heads)
    return _check_layout(context(tp=tp), cfg, splits, checkpointing=True)


def test_stages_tp1_match_whole_model():
    # three stages: vision alone, three decoder layers, the last layer and the head
    _check_layout(ParallelContext.local(), tiny_config(), [1, 4], checkpointing=False)


@pytest.mark.parametrize("tp, kv_heads", [(2, None), (4, None), (2, 2)])
def test_tensor_parallel_and_two_stages_match_tp1(tp, kv_heads):
    losses = run_ranks(_tp_worker, tp, tp, [3], kv_heads)
    assert len(set(losses)) == 1


def test_bad_layouts_fail_clearly():
    cfg = tiny_config()
    fake_tp3 = ParallelContext(dims=ParallelDims(tp=3))  # no groups: fails before any collective
    with pytest.raises(ValueError, match="4 heads cannot be split over tp=3"):
        OpenVLA(cfg, fake_tp3)
    with pytest.raises(ValueError, match="outside the model's 6 blocks"):
        OpenVLA(cfg, blocks=range(4, 7))
    with pytest.raises(ValueError, match="contiguous"):
        OpenVLA(cfg, blocks=[0, 2])
    stage = OpenVLA(cfg, blocks=range(2, 6))
    with pytest.raises(ValueError, match="hidden states"):
        stage(torch.zeros(1, 6, 56, 56), torch.zeros(1, 5, dtype=torch.long))
