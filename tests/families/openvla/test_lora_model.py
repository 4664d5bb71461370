"""LoRA on the tiny OpenVLA at tp=2, in two pipeline stages, and under ZeRO at dp=2 and tp=2 x
dp=2 against the single-process model from the same seed: loss, adapter gradients, adapters
after SGD steps with momentum and clipping (1e-5 of their scale), and a base that no step
touches (bitwise). Each rank builds the tp=1 reference in-process (the model is tiny)."""

import torch

from parallax.families.openvla.model import OpenVLA
from parallax.optim import ZeroOptimizer
from parallax.tensor import shard_tensor, sync_sequence_parallel_grads, unshard_tensor
from parallax.tensor.lora import add_adapter
from parallax.tensor.lora_apply import adapter_parameters, apply_lora, lora_layers
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import (
    SEED,
    assert_rel_close,
    make_batch,
    perturbed_init,
    tiny_config,
)

RANK, ALPHA, CLIP = 4, 8.0, 0.05
# SGD with momentum: unlike Adam, its step keeps the gradient's scale (a wrong dp average or
# clip coefficient shows) and does not blow up the rounding of near-zero gradient elements
OPT = dict(lr=2.0, momentum=0.9, weight_decay=0.01)


@torch.no_grad()
def random_b(model) -> None:
    """Layout-free non-zero B (it starts at zero, which would leave A without gradient): each
    adapter's rows from its own (checkpoint) name, so fused and separate layers agree."""
    for _, layer in lora_layers(model):
        parts = []
        for name in layer.lora_names:
            g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
            rows = layer.out_features // len(layer.lora_names)
            parts.append(torch.randn(rows, RANK, generator=g) * 0.05)
        full = torch.cat(parts)
        info = getattr(layer.lora_B, "tp_shard", None)
        layer.lora_B.copy_(full if info is None else shard_tensor(full, info))


def lora_model(cfg, ctx=None, **kw):
    model = OpenVLA(cfg, ctx, **kw)
    model.init_weights(SEED, perturbed_init)
    report = apply_lora(model, rank=RANK, alpha=ALPHA, seed=0)
    random_b(model)
    return model, report


def _full(p, grad: bool, group):
    t = (p.grad if grad else p).detach()
    info = getattr(p, "tp_shard", None)
    return t if info is None else unshard_tensor(t, info, group)


def _reference(cfg, batches):
    """Single process: loss, adapter gradients, and adapters after two SGD steps (the loss
    of a step is the mean over the dp ranks' batches, as ZeRO averages the gradients)."""
    model, _ = lora_model(cfg)
    params = dict(adapter_parameters(model))
    px, ids, labels = batches[0]
    loss = model.loss(model(px, ids), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in params.items()}
    opt = torch.optim.SGD(params.values(), **OPT)
    model.zero_grad()
    norms = []
    for _ in range(2):
        total = sum(model.loss(model(px, ids), y) for px, ids, y in batches) / len(batches)
        total.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), CLIP))
        opt.step()
        opt.zero_grad()
    after = {n: p.detach().clone() for n, p in params.items()}
    return loss.detach(), grads, (after, norms)


def _chain(stages, px, ids, labels):
    """Two stages as a pipeline runs them: the boundary detached, its gradient sent back."""
    h = stages[0](px, ids)
    inp = h.detach().requires_grad_()
    loss = stages[1].loss(stages[1](inp), labels)
    loss.backward()
    h.backward(inp.grad)
    return loss.detach()


def _tp2_and_stages():
    ctx = context(tp=2)
    cfg = tiny_config()
    batch = make_batch(cfg)
    ref_loss, ref_grads, _ = _reference(cfg, [batch])
    model, report = lora_model(cfg, ctx)
    loss = model.loss(model(*batch[:2]), batch[2])
    loss.backward()
    stages = [lora_model(cfg, ctx, blocks=b)[0] for b in (range(0, 3), range(3, 6))]
    stage_loss = _chain(stages, *batch)
    for m in (model, *stages):
        sync_sequence_parallel_grads(m, ctx.tp_group)  # the replicated factors' partial sums
    assert_rel_close(loss, ref_loss)
    assert_rel_close(stage_loss, ref_loss)
    seen = []
    for m in (model, *stages):
        for name, p in m.named_parameters():
            if name in ref_grads:
                assert_rel_close(_full(p, True, ctx.tp_group), ref_grads[name], msg=name)
                seen.append(name)
            else:
                assert not p.requires_grad and p.grad is None, name  # frozen: no gradient
    assert sorted(seen) == sorted(list(ref_grads) * 2)  # whole model once, the stages once
    return len(report.adapted)


def test_lora_tp2_and_two_stages_match_one_process():
    assert run_ranks(_tp2_and_stages, 2) == [47, 47]


def _zero(tp: int, dp: int):
    ctx = context(tp=tp, dp=dp)
    cfg = tiny_config()
    batches = [make_batch(cfg, seed=s) for s in range(dp)]
    _, _, (ref, ref_norms) = _reference(cfg, batches)
    model, _ = lora_model(cfg, ctx)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.SGD, ctx, **OPT)
    px, ids, labels = batches[ctx.dp_rank]
    for step in range(2):
        model.loss(model(px, ids), labels).backward()
        norm = opt.clip_grad_norm_(CLIP)  # replicated factors counted once, not tp times
        assert_rel_close(norm, ref_norms[step], msg=f"gradient norm, step {step}")
        assert norm > 2 * CLIP  # the clipping acts
        opt.step()
        opt.zero_grad()
    for name, p in adapter_parameters(model):
        assert_rel_close(_full(p, False, ctx.tp_group), ref[name], msg=name)
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]) and p.grad is None, name
    # only the adapters have buffers and state: count the tensors
    adapters = dict(adapter_parameters(model))
    assert set(opt.names) == set(adapters)
    local = sum(p.numel() for p in adapters.values())
    assert sum(b.numel() for b in opt.flat.grad_buffers) <= local + dp * len(opt.layout.buckets)
    states = [v for s in opt.inner.state.values() for v in s.values() if v.dim() > 0]
    assert len(states) == len(opt.inner.param_groups[0]["params"])  # momentum buffers
    assert sum(v.numel() for v in states) <= local // dp + len(opt.layout.buckets)
    return local, sum(base[n].numel() for n in base)


def test_lora_under_zero_dp2_matches_one_process():
    (adapters, frozen), _ = run_ranks(_zero, 2, 1, 2)
    assert 0 < adapters < frozen / 10


def test_lora_under_zero_tp2_dp2_matches_one_process():
    results = run_ranks(_zero, 4, 2, 2)
    assert len({r[0] for r in results}) == 1


def test_add_adapter_refuses_what_it_cannot_do():
    import pytest
    from torch import nn

    from parallax.tensor import ColumnParallelLinear

    with pytest.raises(TypeError, match="exactly"):
        add_adapter(nn.Linear(4, 4), ("x",), 2, 4.0)
    fused = ColumnParallelLinear(4, 6, partitions=3, ctx=None)
    with pytest.raises(ValueError, match="1 or 3 adapters"):
        add_adapter(fused, ("a", "b"), 2, 4.0)
    with pytest.raises(ValueError, match="positive integer"):
        add_adapter(fused, ("a",), 0, 4.0)
    from parallax import ParallelContext, ParallelDims

    fake_tp2 = ParallelContext(dims=ParallelDims(tp=2))  # no groups: nothing communicates
    with pytest.raises(ValueError, match="same dropout mask"):
        add_adapter(ColumnParallelLinear(4, 6, ctx=fake_tp2), ("a",), 2, 4.0, dropout=0.1)
    from parallax.tensor import RowParallelLinear

    row = add_adapter(RowParallelLinear(4, 6, ctx=fake_tp2), ("a",), 2, 4.0, dropout=0.1)
    assert row.lora_dropout == 0.1  # split input: independent masks are a dense dropout


def test_bf16_base_fp32_adapters():
    """A bf16 model: the adapters are fp32 parameters (ZeRO's fp32 buffers are their own
    masters: no separate copy), the forward runs in bf16, the frozen base stays bf16 and
    unchanged."""
    from parallax import ParallelContext

    model = OpenVLA(tiny_config(), dtype=torch.bfloat16, seed=0)
    apply_lora(model, rank=RANK, alpha=ALPHA)
    random_b(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    assert {p.dtype for _, p in adapter_parameters(model)} == {torch.float32}
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ParallelContext.local())
    assert [b.dtype for b in opt.flat.param_buffers] == [torch.float32]
    assert opt.flat.master_flat is None  # fp32 buckets: the parameters are the masters
    px, ids, labels = make_batch(tiny_config())
    logits = model(px, ids)
    assert logits.dtype == torch.bfloat16
    model.loss(logits, labels).backward()
    assert all(p.grad.dtype == torch.float32 for _, p in adapter_parameters(model))
    before = {n: p.detach().clone() for n, p in adapter_parameters(model)}
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in adapter_parameters(model))
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
