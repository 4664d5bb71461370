"""LLaVA-NeXT at tp=2, in pipeline stages, and both, against the tp=1 model from the same seed
(float32, gloo), on a batch of mixed image sizes and tile counts with a text-only sample.

Each rank builds the tp=1 model in-process (it is tiny) and compares its shard of the logits,
the loss and every gradient (gathered over tp, matched by layout-free name). Stages are chained
by hand as an executor would (detached boundary, backward with the received gradient).
"""

import pytest
import torch

from parallax import ParallelContext, ParallelDims
from parallax.families.llava_next.model import LlavaNext
from parallax.families.llava_next.objective import labelled_rows, rows_answer_metrics, rows_loss
from parallax.tensor import unshard_tensor
from parallax.testing import context, run_ranks
from tests.families.llava_next.helpers import make_batch, tiny_config
from tests.families.openvla.helpers import SEED, assert_rel_close, perturbed_init


def _model(cfg, ctx=None, **kw):
    model = LlavaNext(cfg, ctx, **kw)
    model.init_weights(SEED, perturbed_init)
    return model


def _inputs(batch):
    return batch["pixel_values"], batch["input_ids"], batch["image_sizes"]


def _reference(cfg, batch):
    model = _model(cfg)
    logits = model(*_inputs(batch))
    loss = model.loss(logits, batch["labels"])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    tokens = model.generate(*_inputs(_prompt(batch)), 6)
    return logits.detach(), loss.detach(), grads, model.metrics(logits, batch["labels"]), tokens


def _prompt(batch):
    """The first sample cut just before its answer, as a generation prompt."""
    first = int((batch["labels"][0] != -100).nonzero()[0]) - 1  # the label of position first
    return {
        "pixel_values": batch["pixel_values"][:1],
        "input_ids": batch["input_ids"][:1, : first + 1],
        "image_sizes": batch["image_sizes"][:1],
    }


def _check_grads(stages, ref_grads, group):
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            info = getattr(p, "tp_shard", None)
            grad = p.grad if info is None else unshard_tensor(p.grad, info, group)
            assert_rel_close(grad, ref_grads[name], msg=name)
            seen.add(name)
    assert seen == set(ref_grads)


def _chain(stages, batch, labelled: bool):
    x, outputs = _inputs(batch), []
    for stage in stages:
        inputs = x if stage.has_vision else (x[0].detach().requires_grad_(),)
        stage.return_hidden = labelled and stage.has_head
        out = stage(*inputs)
        outputs.append((inputs, out))
        x = (out,)
    last = stages[-1]
    if labelled:  # the head on the labelled rows only, as a trainer's "labelled" logits mode
        rows, targets = labelled_rows(batch["labels"])
        logits = last.head(outputs[-1][1].flatten(0, 1).index_select(0, rows))
        n = (batch["labels"][:, 1:] != -100).sum()
        loss = rows_loss(logits, targets, last.ctx, vocab_size=last.config.vocab_size) / n
        b, t = batch["input_ids"].shape
        metrics = rows_answer_metrics(
            logits, targets, rows, t, b, last.ctx, vocab_size=last.config.vocab_size
        )
    else:
        logits = outputs[-1][1]
        loss = last.loss(logits, batch["labels"])
        metrics = last.metrics(logits, batch["labels"])
    grad = None
    for inputs, out in reversed(outputs):
        if grad is None:
            loss.backward()
        else:
            out.backward(grad)
        grad = inputs[0].grad
    return logits.detach(), loss.detach(), metrics


def _check_layout(ctx, cfg, splits, checkpointing):
    batch = make_batch(cfg)
    ref_logits, ref_loss, ref_grads, ref_metrics, ref_tokens = _reference(cfg, batch)
    shard = -(-ref_logits.shape[-1] // ctx.tp_size)
    mine = ref_logits[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard]

    model = _model(cfg, ctx)
    logits = model(*_inputs(batch))
    assert_rel_close(logits[..., : mine.shape[-1]], mine, msg="logits")
    loss = model.loss(logits, batch["labels"])
    assert_rel_close(loss, ref_loss, msg="loss")
    loss.backward()
    _check_grads([model], ref_grads, ctx.tp_group)
    for key, value in model.metrics(logits, batch["labels"]).items():
        assert value.item() == ref_metrics[key].item(), key
    for use_cache in (True, False):
        tokens = model.generate(*_inputs(_prompt(batch)), 6, use_cache=use_cache)
        assert torch.equal(tokens, ref_tokens), use_cache

    n = len(LlavaNext.stage_blocks(cfg))
    bounds = [0, *splits, n]
    for labelled in (False, True):
        stages = [
            _model(cfg, ctx, blocks=range(a, b), activation_checkpointing=checkpointing)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        logits, loss, metrics = _chain(stages, batch, labelled)
        if not labelled:
            assert_rel_close(logits[..., : mine.shape[-1]], mine, msg="staged logits")
        assert_rel_close(loss, ref_loss, msg=f"staged loss, labelled={labelled}")
        _check_grads(stages, ref_grads, ctx.tp_group)
        for key, value in metrics.items():
            assert value.item() == ref_metrics[key].item(), key
    return loss.item()


def test_two_stages_tp1_match_whole_model():
    # vision + llm.0 | llm.1 + head, recomputing blocks in the backward
    _check_layout(ParallelContext.local(), tiny_config(), [2], checkpointing=True)


def _tp_worker(splits, fused):
    return _check_layout(context(tp=2), tiny_config(fused_projections=fused), splits, False)


@pytest.mark.parametrize("splits, fused", [([1, 3], False), ([2], True)])
def test_tp2_and_stages_match_tp1(splits, fused):
    # the vocabulary of 131 is padded to 132 over tp=2; a text-only sample is in the batch
    losses = run_ranks(_tp_worker, 2, splits, fused)
    assert losses[0] == losses[1]


def test_text_only_batch_keeps_the_tower_in_the_graph():
    cfg = tiny_config()
    model = _model(cfg)
    batch = make_batch(cfg, sizes=[None, None])
    model.loss(model(*_inputs(batch)), batch["labels"]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if name.startswith(("vision_tower.", "multi_modal_projector.", "image_newline")):
            assert not p.grad.any(), name


def test_bad_inputs_and_layouts_fail_clearly():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="4 heads cannot be split over tp=3"):
        LlavaNext(cfg, ParallelContext(dims=ParallelDims(tp=3)))
    with pytest.raises(ValueError, match="outside the model's 4 blocks"):
        LlavaNext(cfg, blocks=range(2, 5))
    model = _model(cfg)
    batch = make_batch(cfg, sizes=[(30, 40), None])
    px, ids, sizes = _inputs(batch)
    with pytest.raises(
        ValueError, match="sample 1: 0 image tokens in input_ids, but an image of 60x20 gives 22"
    ):
        model(px, ids, torch.tensor([[30, 40], [60, 20]]))
    with pytest.raises(
        ValueError, match=r"sample 0: an image of 30x40 needs 5 tiles, pixel_values has 4"
    ):
        model(px[:, :4], ids, sizes)
    with pytest.raises(ValueError, match="first stage takes"):
        model(px, ids)
    with pytest.raises(ValueError, match="hidden states"):
        LlavaNext(cfg, blocks=range(1, 4))(px, ids, sizes)
