"""Bad input for the SigLIP/CLIP recipe: one clear message on every rank before any collective
(images of the wrong size, captions longer than the text tower, unequal microbatches, a global
batch that does not divide over dp, pp > 1), and the collator's truncation and resizing."""

import pytest
import torch

from parallax.dims import ParallelDims
from parallax.families.siglip.batches import PairCollator
from parallax.families.siglip.recipe import SiglipRecipe
from parallax.recipe import resolve
from parallax.testing import run_ranks
from parallax.train.trainer import Trainer
from tests.families.siglip.helpers import tiny
from tests.families.siglip.test_train import _batch, _cfg, _ctx, _local


def _bad_inputs(dp: int) -> list[str]:
    ctx, recipe, said = _ctx(1, dp), SiglipRecipe(), []
    config, cfg = tiny("siglip"), _cfg(dp=dp, micro_batch_size=2)
    trainer = Trainer(resolve(cfg, recipe=recipe, model_config=config), ctx)
    px, ids = _batch(config)
    for rank_only, change in (
        (ctx.dp_rank == 1, lambda mb: {**mb, "pixel_values": mb["pixel_values"][..., :8]}),
        (ctx.dp_rank == 0, lambda mb: {**mb, "input_ids": torch.ones(2, 99, dtype=torch.long)}),
        (ctx.dp_rank == 1, lambda mb: {k: v[:1] for k, v in mb.items()}),
    ):
        mbs = _local(ctx, cfg, px, ids)
        if rank_only:
            mbs[0] = change(mbs[0])
        with pytest.raises(ValueError) as err:
            trainer.train_step(mbs)
        said.append(str(err.value))
    with pytest.raises(ValueError) as err:  # 6 pairs do not split over 4 dp ranks
        Trainer(
            resolve(_cfg(dp=dp, global_batch_size=6, micro_batch_size=1), model_config=config), ctx
        )
    said.append(str(err.value))
    return said


def test_bad_input_fails_on_every_rank_before_any_collective():
    said = run_ranks(_bad_inputs, 4, 4)
    assert all(s == said[0] for s in said)  # one message, on every rank
    images, captions, sizes, batch = said[0]
    assert "pixel_values must be (b, 3, 16, 16)" in images and "rank 1" in images
    assert "t <= 8" in captions and "rank 0" in captions
    assert "--micro-batch-size 2" in sizes
    assert "global batch size 6 is not divisible by micro batch size 1 x dp 4" in batch
    with pytest.raises(ValueError, match="pipeline parallelism"):
        run = resolve(_cfg(), recipe=SiglipRecipe(), model_config=tiny("siglip"))
        run.recipe.model.check_layout(run, ParallelDims(pp=2))


def test_collator_truncates_and_counts_long_captions_and_resizes_images():
    config = tiny("siglip")  # text max length 8, images 16 x 16
    collate = PairCollator(config, None, None)
    rng = torch.Generator().manual_seed(0)
    image = lambda s: torch.randint(0, 255, (s, s, 3), generator=rng, dtype=torch.uint8).numpy()  # noqa: E731
    mb = collate(
        [
            {"image": image(16), "caption": "a cat"},
            {"image": image(40), "caption": "a very long caption indeed"},
        ]
    )
    assert mb["truncated"] == 1 and mb["resized"] == 1
    assert mb["pixel_values"].shape == (2, 3, 16, 16) and mb["input_ids"].shape == (2, 8)
    assert mb["input_ids"][1, -1] == 1  # the end token kept
