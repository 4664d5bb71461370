"""The llava recipe through the one Trainer: every layout equals one process on batches of mixed
lengths and tile counts (the loss normalised by the supervised tokens of the global batch), the
default LLaVA-v1.6 learning-rate groups, and stage-1 freezing."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.families.llava_next.synthetic import SyntheticVQA
from parallax.recipe import registry, resolve
from parallax.run import TrainConfig
from parallax.run.param_groups import param_groups
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer
from tests.families.llava_next.helpers import tiny_config
from tests.families.openvla.helpers import assert_rel_close

STEPS = 3


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="llava-tiny",
        steps=STEPS,
        global_batch_size=8,
        micro_batch_size=2,
        warmup_steps=1,
        lr=3e-3,
        grad_clip=1.0,
        seed=5,
    )
    return TrainConfig(**{**base, **kw})


def _data() -> SyntheticVQA:
    return SyntheticVQA(seed=2, num_samples=48, text_only_fraction=0.25)


def _run(tp: int, pp: int, dp: int, **kw):
    ctx = ParallelContext.local() if tp * pp * dp == 1 else context(tp=tp, pp=pp, dp=dp)
    cfg = _cfg(tp=tp, pp=pp, dp=dp, **kw)
    # a vocabulary that tp=2 pads (131 rows): the padding must stay out of the loss
    trainer = Trainer(resolve(cfg, model_config=tiny_config()), ctx)
    recipe, data = trainer.recipe, _data()
    loader = recipe.data.loader(data, trainer.run, ctx)
    collate = recipe.data.collator(trainer.run, data)
    before = {n: full_tensor(p, ctx.tp_group).clone() for n, p in trainer.named_parameters()}
    history, widths = [], []
    for _ in range(STEPS):
        mbs = [collate(s) for s in loader.next_batch()]
        widths.append(
            [tuple(m["pixel_values"].shape[1:2]) + (m["input_ids"].shape[1],) for m in mbs]
        )
        out = trainer.train_step(mbs)
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    after = {n: full_tensor(p, ctx.tp_group) for n, p in trainer.named_parameters()}
    return history, {n: (w, w - before[n]) for n, w in after.items()}, widths


@pytest.fixture(scope="module")
def reference():
    return _run(1, 1, 1)


def test_batches_mix_lengths_and_tiles(reference):
    """The test is only worth something if microbatches differ in length and tile count."""
    _, _, widths = reference
    flat = [w for step in widths for w in step]
    assert len({w[1] for w in flat}) > 2 and len({w[0] for w in flat}) > 1, flat


@pytest.mark.parametrize(
    "tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)], ids=["tp2", "pp2", "dp2", "tp2pp2dp2"]
)
def test_layouts_match_one_process(reference, tp, pp, dp):
    ref_history, ref_updates, _ = reference
    seen = {}
    for history, updates, _ in run_ranks(_run, tp * pp * dp, tp, pp, dp):
        assert_rel_close(torch.tensor(history), torch.tensor(ref_history), msg="history")
        seen.update(updates)
    assert sorted(seen) == sorted(ref_updates)
    # AdamW divides by sqrt(v): float32 noise in a gradient element near 0 moves that element's
    # update by up to a few % of the learning rate, while a wrong gradient moves it by O(lr)
    lr = _cfg().lr
    for name, (weight, delta) in ref_updates.items():
        assert_close(seen[name][0], weight, rtol=1e-5, atol=5e-2 * lr, msg=name)
        assert delta.abs().max() > 0.1 * lr, name  # every parameter was trained
    losses = [h[0] for h in ref_history]
    assert losses[-1] < losses[0]


def test_default_lr_groups_are_llava_v16_and_stage_1_trains_the_projector_only():
    cfg = _cfg(lr=None, model="llava-v1.6-vicuna-7b")
    recipe = registry.find(cfg.model)
    assert recipe.model.default_lr("llava-v1.6-vicuna-7b") == 2e-5
    assert recipe.model.default_lr_groups("llava-v1.6-vicuna-7b", 2e-5) == {
        "vision_tower.*": pytest.approx(2e-6)
    }
    trainer = Trainer(resolve(_cfg(lr=None), model_config=tiny_config()), ParallelContext.local())
    named = trainer.named_parameters()
    lrs = {n: g["lr"] for g in param_groups(named, trainer.run) for n, _ in g["params"]}
    assert lrs["vision_tower.patch_embed.proj.weight"] == pytest.approx(3e-4)
    assert lrs["multi_modal_projector.linear_1.weight"] == pytest.approx(3e-3)
    assert lrs["language_model.model.layers.0.mlp.down_proj.weight"] == pytest.approx(3e-3)
    stage1 = Trainer(
        resolve(_cfg(freeze="vision,llm"), model_config=tiny_config()), ParallelContext.local()
    )
    trainable = {n for n, p in stage1.named_parameters() if p.requires_grad}
    assert trainable and all(
        n.startswith(("multi_modal_projector.", "image_newline")) for n in trainable
    )


def test_flops_and_tokens_count_no_padding():
    """A padded microbatch counts what its samples count one by one (with the collator's
    ``lengths``/``num_tiles`` or read from the padding and ``image_sizes``)."""
    run, data = resolve(_cfg(), model_config=tiny_config()), _data()
    model, collate = run.recipe.model, run.recipe.data.collator(run, data)
    samples = [data[i] for i in range(6)]
    mb = collate(samples)
    bare = {k: v for k, v in mb.items() if k not in ("lengths", "num_tiles")}
    alone = [collate([s]) for s in samples]
    want = sum(model.flops(run, [m]) for m in alone)
    assert model.flops(run, [mb]) == pytest.approx(want)
    assert model.flops(run, [bare]) == pytest.approx(want)
    tokens = sum(m["input_ids"].numel() for m in alone)
    assert model.tokens(run, [mb]) == model.tokens(run, [bare]) == tokens
    assert mb["input_ids"].numel() > tokens  # the batch is padded


def test_a_microbatch_whose_image_tokens_do_not_fit_is_named():
    run, data = resolve(_cfg(), model_config=tiny_config()), _data()
    side = run.recipe.data
    mb = side.collator(run, data)([data[i] for i in range(4)])
    assert side.input_problem(run, mb) is None
    mb["image_sizes"][0] = torch.tensor([0, 0])  # its image tokens now belong to no image
    assert "image tokens in input_ids" in side.input_problem(run, mb)
