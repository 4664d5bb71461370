"""The recipe protocol with a second, deliberately different family (``toy_recipe.py``): a
loss over the whole step and a dp all-gather through the same Trainer, equal to one process,
and a layout the recipe refuses refused on every rank."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer
from tests.recipe.toy_recipe import Pairs, ToyRecipe, reference_loss

# -- a second family: two towers, a loss over the whole step and a dp all-gather -------------


def _toy_cfg(**kw) -> TrainConfig:
    base = dict(
        model="toy", steps=3, global_batch_size=16, micro_batch_size=4, warmup_steps=1, lr=3e-2
    )
    return TrainConfig(**{**base, **kw})


def _toy_run(tp: int, dp: int) -> tuple[list, dict]:
    ctx = ParallelContext.local() if tp * dp == 1 else context(tp=tp, dp=dp)
    recipe = ToyRecipe()
    cfg = _toy_cfg(tp=tp, dp=dp)
    trainer = Trainer(resolve(cfg, recipe=recipe), ctx)
    data, collate = Pairs(), recipe.data.collator(None, None)
    per_rank = cfg.global_batch_size // dp
    history = []
    for step in range(cfg.steps):
        start = step * cfg.global_batch_size + ctx.dp_rank * per_rank
        rows = list(range(start, start + per_rank))
        mbs = [
            collate([data[i] for i in rows[j : j + cfg.micro_batch_size]])
            for j in range(0, per_rank, cfg.micro_batch_size)
        ]
        out = trainer.train_step(mbs)
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    weights = {n: full_tensor(p, ctx.tp_group) for n, p in trainer.named_parameters()}
    return history, weights


@pytest.fixture(scope="module")
def toy_reference():
    return _toy_run(1, 1)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 1), (2, 2)], ids=["dp2", "tp2", "tp2dp2"])
def test_a_step_level_recipe_matches_one_process(toy_reference, tp, dp):
    ref_history, ref_weights = toy_reference
    for history, weights in run_ranks(_toy_run, tp * dp, tp, dp):
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-6)
        for name, value in ref_weights.items():
            assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert ref_history[-1][0] < ref_history[0][0]


def test_the_step_level_loss_is_the_global_batch_loss_written_out():
    """The recipe's first loss (spread over microbatches) equals the formula on the batch."""
    recipe = ToyRecipe()
    cfg = _toy_cfg(steps=1)
    trainer = Trainer(resolve(cfg, recipe=recipe), ParallelContext.local())
    data = Pairs()
    x, y = data.x[:16], data.y[:16]
    want = reference_loss(trainer.chunks[0], x, y).item()
    collate = recipe.data.collator(None, None)
    mbs = [collate([data[i] for i in range(j, j + 4)]) for j in range(0, 16, 4)]
    assert trainer.train_step(mbs).loss.item() == pytest.approx(want, rel=1e-6)


def _toy_pp2() -> str | None:
    try:
        Trainer(resolve(_toy_cfg(pp=2, global_batch_size=8), recipe=ToyRecipe()), context(pp=2))
    except ValueError as err:
        return str(err)
    return None


def test_a_recipe_refuses_a_layout_on_every_rank():
    messages = run_ranks(_toy_pp2, 2, timeout=60)
    assert all(m and "pp = 1" in m for m in messages), messages
