"""LLaVA-NeXT at tp=1 against the plain reference in llava_helpers.py (float32): the same
llava-hf tensors give the same logits and loss, and the AnyRes packing equals transformers'."""

import json

import pytest
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


# config.json as transformers 5.18 ``LlavaNextConfig.save_pretrained`` writes it for a
# 128-token vocabulary: no pad_token_id at the top level, null in the text config, rope_theta
# under rope_parameters
TRANSFORMERS_5 = {
    "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]],
    "image_seq_length": 576,
    "image_token_index": 126,
    "model_type": "llava_next",
    "multimodal_projector_bias": True,
    "projector_hidden_act": "gelu",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 176, "max_position_embeddings": 2048,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 4, "pad_token_id": None,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 128,
    },
    "tie_word_embeddings": False,
    "transformers_version": "5.18.0",
    "vision_config": {
        "attention_dropout": 0.0, "hidden_act": "quick_gelu", "hidden_size": 32,
        "image_size": 28, "initializer_factor": 1.0, "initializer_range": 0.02,
        "intermediate_size": 128, "layer_norm_eps": 1e-05, "model_type": "clip_vision_model",
        "num_attention_heads": 4, "num_channels": 3, "num_hidden_layers": 3, "patch_size": 14,
        "projection_dim": 512,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
}  # fmt: skip


def test_a_transformers_5_checkpoint_without_a_pad_id_loads_and_matches(tmp_path):
    import copy
    from dataclasses import replace

    from parallax.families.llava_next.config import LlavaNextConfig
    from parallax.families.llava_next.recipe import LlavaRecipe

    (tmp_path / "config.json").write_text(json.dumps(TRANSFORMERS_5))
    cfg = LlavaNextConfig.from_pretrained(tmp_path)
    assert (cfg.vocab_size, cfg.image_token_index, cfg.pad_token_id) == (128, 126, 127)
    sd = hf_tensors(cfg)
    save_file(sd, str(tmp_path / "model.safetensors"))
    assert LlavaRecipe().model.resolve(str(tmp_path)).config.pad_token_id == 127
    model = LlavaNext.from_pretrained(tmp_path, dtype=torch.float32)
    batch = make_batch(replace(cfg, tokenizer="tiny"), sizes=[(30, 40), None])  # ids < 128
    assert (batch["input_ids"][1] == 127).any()  # the shorter sample is padded with it
    args = batch["pixel_values"], batch["input_ids"], batch["image_sizes"]
    assert_rel_close(model(*args), ref_llava(sd, cfg, *args), msg="logits")
    # where a file names the pad id, it is used; at the vocabulary's edge it is derived below
    named = copy.deepcopy(TRANSFORMERS_5)
    named["text_config"]["pad_token_id"] = 0
    assert LlavaNextConfig.from_dict(named).pad_token_id == 0
    edge = {**copy.deepcopy(TRANSFORMERS_5), "image_token_index": 127}
    assert LlavaNextConfig.from_dict(edge).pad_token_id == 126
    scaled = copy.deepcopy(TRANSFORMERS_5)
    scaled["text_config"]["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "llama3"}
    with pytest.raises(ValueError, match="rope_type='llama3' is not supported"):
        LlavaNextConfig.from_dict(scaled)
    scaled["text_config"]["rope_parameters"]["rope_type"] = "default"
    assert LlavaNextConfig.from_dict(scaled).text.rope_theta == 5e5
