"""The siglip recipe's data: ``--data`` as a captions folder (JSONL or CSV) or WebDataset tar
shards streamed through the PairLoader, the synthetic task's held-out split, and checkpoint
detection by config.json."""

import json

import pytest
import torch

from parallax import ParallelContext
from parallax.data import PairFolder, TarShards, write_pair_folder, write_tar_shards
from parallax.families.siglip.data import IndexedPairs, open_pairs
from parallax.families.siglip.recipe import SiglipRecipe
from parallax.recipe import registry, resolve
from parallax.run import TrainConfig


def _pairs(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randint(0, 255, (20, 24, 3), generator=g, dtype=torch.uint8).numpy(),
            "caption": f"pair number {i}",
            "key": f"{i:04d}",
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("layout", ["jsonl", "csv", "tar"])
def test_data_folders_and_tar_shards_stream_through_the_recipe(tmp_path, layout):
    recipe = SiglipRecipe()
    if layout == "tar":
        write_tar_shards(tmp_path, _pairs(12), per_shard=5)
    else:
        write_pair_folder(tmp_path, _pairs(12), fmt=layout)
    cfg = TrainConfig(model="siglip-tiny", data=str(tmp_path), global_batch_size=4)
    run = resolve(cfg.replace(micro_batch_size=2), recipe=recipe)
    data = recipe.data.dataset(run.data, run)
    assert isinstance(data, TarShards if layout == "tar" else PairFolder)
    loader = recipe.data.loader(data, run, ParallelContext.local())
    collate = recipe.data.collator(run, data)
    for _ in range(3):  # one epoch of 12 pairs, every pair once
        mbs = [collate(samples) for samples in loader.next_batch()]
        assert [mb["pixel_values"].shape for mb in mbs] == [(2, 3, 32, 32)] * 2
        assert all(mb["resized"] == 2 and mb["truncated"] == 0 for mb in mbs)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["samples_seen"] == 12
    assert len(IndexedPairs(data)) == 12


def test_synthetic_eval_split_and_bad_specs():
    recipe = SiglipRecipe()
    cfg = resolve(TrainConfig(model="siglip-tiny", global_batch_size=8, eval_batches=3))
    held = recipe.data.eval_dataset(None, cfg)
    assert len(held) == 24 and held[0]["key"].startswith("eval-")
    assert len(held.class_names()) == 18
    with pytest.raises(ValueError, match="synthetic:N"):
        open_pairs("synthetic:x", 32, 0)
    with pytest.raises(Exception, match="no such file"):
        recipe.data.dataset("no/such/dir", cfg)
    cfg = cfg.replace(data="/some/folder")
    with pytest.raises(ValueError, match="--eval-data"):
        recipe.data.eval_dataset(None, cfg)


def test_checkpoints_are_found_by_their_config_json(tmp_path):
    for model_type in ("siglip", "clip"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert registry.find(str(tmp_path / model_type)).name == "siglip"
    for preset in ("siglip-tiny", "siglip-large-patch16-256", "clip-vit-large-patch14"):
        assert registry.find(preset).name == "siglip"
    assert registry.resolve("clip-vit-large-patch14")[1].config.loss == "softmax"
    assert registry.resolve("siglip-base-patch16-224")[1].config.loss == "sigmoid"
