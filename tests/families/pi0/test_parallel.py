"""tp=2 against tp=1 on gloo, float32: the same logical weights give the same flow-matching
loss, the same gradients (sharded ones gathered; the replicated key/value head's and the
heads' whole on every rank) and the same sampled chunk for the same noise, both variants in
one spawn of ranks; with LoRA on every linear (the replicated key/value projections' adapters
included, whole on every rank) the same loss and adapter gradients."""

from torch.testing import assert_close

from parallax import comm
from parallax.families.pi0.objective import flow_matching_loss
from parallax.families.pi0.predict import sample_chunk
from parallax.tensor import unshard_tensor
from parallax.testing import context, run_ranks
from tests.families.pi0.helpers import inputs, lora_model, tiny_model

PREFIX_KEYS = ("images", "image_masks", "tokens", "token_mask", "state", "noise")


def _loss_grads_chunk(model, x):
    loss = flow_matching_loss(model, x, noise=x["noise"], time=x["time"])
    loss.backward()
    chunk = sample_chunk(model, *(x[k] for k in PREFIX_KEYS), num_steps=3)
    return loss.detach(), chunk


def _tp2_case() -> None:
    ctx = context(tp=2)
    _lora_case(ctx)
    for variant in ("pi0", "pi05"):
        one, two = tiny_model(variant), tiny_model(variant, ctx)
        x = inputs(one.config)
        loss1, chunk1 = _loss_grads_chunk(one, x)
        loss2, chunk2 = _loss_grads_chunk(two, x)
        assert_close(loss2, loss1, rtol=1e-5, atol=0)
        assert_close(chunk2, chunk1, rtol=1e-5, atol=1e-5)
        grads = dict(one.named_parameters())
        unused = set(one.unused_names())
        for name, p in two.named_parameters():
            if name in unused:
                assert p.grad is None, name
                continue
            want = grads[name].grad
            info = getattr(p, "tp_shard", None)
            got = p.grad if info is None else unshard_tensor(p.grad, info, ctx.tp_group)
            scale = want.abs().max().item()
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * scale + 1e-5 * got.abs().max().item(), (variant, name, err, scale)


def _lora_case(ctx) -> None:
    for variant in ("pi0", "pi05"):
        one, two = lora_model(variant), lora_model(variant, ctx)
        x = inputs(one.config)
        losses = [flow_matching_loss(m, x, noise=x["noise"], time=x["time"]) for m in (one, two)]
        for loss in losses:
            loss.backward()
        assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
        grads = {n: p.grad for n, p in one.named_parameters() if p.grad is not None}
        seen = set()
        for name, p in two.named_parameters():
            if name not in grads:
                continue
            got = p.grad.clone()
            if getattr(p, "sequence_parallel", False):  # a column adapter's A: partial
                comm.all_reduce(got, ctx.tp_group)
            info = getattr(p, "tp_shard", None)
            got = got if info is None else unshard_tensor(got, info, ctx.tp_group)
            # an adapter's gradient sums terms over the features tp splits, and where they
            # cancel the order of the sums shows: up to 2.1e-5 of the tensor's largest (one
            # element of 64, on an AVX-512 CPU); a wrong split or a missing sum is off by the
            # largest's order
            atol = 1e-4 * grads[name].abs().max().item()
            assert_close(got, grads[name], rtol=1e-5, atol=atol)
            seen.add(name)
        assert seen == grads.keys()
        kv = [n for n in seen if ".k_proj.lora_" in n or ".v_proj.lora_" in n]
        assert len(kv) == 4 * 2 * one.config.depth, kv  # A and B of k and v, both streams
        assert all(grads[n].abs().max() > 0 for n in kv)


def test_activation_checkpointing_and_compiling_change_no_gradient():
    plain, recomputed, compiled = (tiny_model("pi05") for _ in range(3))
    recomputed.set_activation_checkpointing(True)
    compiled.compile_blocks(backend="aot_eager")  # traced as --compile does; no C++ compiler
    x = inputs(plain.config)
    for model in (plain, recomputed, compiled):
        flow_matching_loss(model, x, noise=x["noise"], time=x["time"]).backward()
    grads = dict(plain.named_parameters())
    for other in (recomputed, compiled):
        for name, p in other.named_parameters():
            if p.grad is not None or grads[name].grad is not None:
                assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tp2_equals_tp1():
    run_ranks(_tp2_case, 2)
