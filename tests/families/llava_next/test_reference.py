"""LLaVA-NeXT at tp=1 against the plain reference in llava_helpers.py (float32): the same
llava-hf tensors give the same logits and loss, and the AnyRes packing equals transformers'."""

import json

import torch
from safetensors.torch import save_file

from parallax.families.llava_next import anyres
from parallax.families.llava_next.model import LlavaNext
from tests.families.llava_next.helpers import (
    IMAGE_SIZES,
    hf_tensors,
    make_batch,
    ref_llava,
    ref_loss,
    ref_pack,
    tiny_config,
)
from tests.families.openvla.helpers import assert_rel_close


def test_tp1_matches_reference_from_a_llava_hf_checkpoint(tmp_path):
    cfg = tiny_config(vocab=192)
    sd = hf_tensors(cfg)
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    model = LlavaNext.from_pretrained(tmp_path, dtype=torch.float32)
    batch = make_batch(cfg)
    args = batch["pixel_values"], batch["input_ids"], batch["image_sizes"]
    logits = model(*args)
    ref = ref_llava(sd, cfg, *args)
    assert logits.shape == (len(IMAGE_SIZES), batch["input_ids"].shape[1], 192)
    assert_rel_close(logits, ref, msg="logits")
    assert_rel_close(
        model.loss(logits, batch["labels"]), ref_loss(ref, batch["labels"]), msg="loss"
    )
    m = model.metrics(logits, batch["labels"])
    gt = batch["labels"][:, 1:]
    ok = (ref[:, :-1].argmax(-1) == gt) & (gt != -100)
    assert m["token_correct"].item() == ok.sum().item()
    assert m["tokens"].item() == (gt != -100).sum().item()


def test_pack_matches_transformers_unpad_and_newline():
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    newline = torch.randn(8, generator=g)
    sizes = [(30, 40), (60, 20), (56, 30), (20, 80), (28, 28), (81, 29), (29, 81), (57, 55)]
    for size in sizes:
        n = anyres.num_tiles(size, cfg.image_grid_pinpoints, cfg.tile_size)
        feats = torch.randn(n, cfg.tile_tokens, 8, generator=g)
        got = anyres.pack_image(feats, size, cfg.image_grid_pinpoints, cfg.tile_size, newline)
        assert torch.equal(got, ref_pack(feats, size, cfg, newline)), size
