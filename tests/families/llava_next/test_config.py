"""LLaVA-NeXT presets, config.json in both formats, the block list and the FLOPs formula."""

import math

import pytest

from parallax.families.llava_next.checkpoint import CheckpointLayout
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.flops import llm_forward_flops, sample_flops, vision_forward_flops
from parallax.families.llava_next.model import LlavaNext


def test_7b_preset_has_the_published_shapes_and_count():
    cfg = LlavaNextConfig.preset("llava-v1.6-vicuna-7b")
    model = LlavaNext(cfg, device="meta")
    built = sum(p.numel() for p in model.parameters())
    unused = sum(math.prod(s) for s in CheckpointLayout(cfg).unused().values())
    assert built + unused == 7_063_431_168  # models.md 1.1: llava-hf's parameter count
    assert unused == 12_596_224 + 2 * 1024  # CLIP layer 24 and post_layernorm, never built
    assert list(model.vision_tower.blocks) == [str(i) for i in range(23)]
    assert model.language_model.model.embed_tokens.weight.shape == (32064, 4096)
    assert model.vision_tower.patch_embed.proj.bias is None
    assert cfg.max_tiles == 5 and cfg.max_image_tokens == 2928
    names = [b.name for b in LlavaNext.stage_blocks(cfg)]
    assert names == ["vision"] + [f"llm.{i}" for i in range(32)] + ["head"]


def test_config_json_round_trip_and_original_format():
    cfg = LlavaNextConfig.preset("llava-tiny")
    back = LlavaNextConfig.from_dict(cfg.to_dict())
    assert (back.vision, back.text, back.image_grid_pinpoints) == (
        cfg.vision,
        cfg.text,
        cfg.image_grid_pinpoints,
    )
    assert (back.image_token_index, back.pad_token_id, back.tokenizer) == (128, 129, "tiny")
    original = {
        "model_type": "llava_llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
        "mm_vision_tower": "openai/clip-vit-large-patch14-336",
        "mm_projector_type": "mlp2x_gelu",
        "mm_patch_merge_type": "spatial_unpad",
        "image_aspect_ratio": "anyres",
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "mm_vision_select_layer": -2,
    }
    cfg7 = LlavaNextConfig.from_dict(original)
    ref = LlavaNextConfig.preset("llava-v1.6-vicuna-7b")
    assert cfg7.text == ref.text and cfg7.vision == ref.vision
    assert (cfg7.image_token_index, cfg7.pad_token_id, cfg7.checkpoint_vocab_size) == (
        32000,
        32001,
        32000,
    )
    # (width, height) in the original file: (1008 wide, 336 high) becomes (336, 1008)
    assert cfg7.image_grid_pinpoints[3] == (336, 1008)
    assert LlavaNextConfig.from_dict(cfg7.to_dict()).text == ref.text  # written as llava-hf
    with pytest.raises(ValueError, match="mm_projector_type='linear' is not supported"):
        LlavaNextConfig.from_dict({**original, "mm_projector_type": "linear"})
    with pytest.raises(ValueError, match="unknown mm_vision_tower"):
        LlavaNextConfig.from_dict({**original, "mm_vision_tower": "x/y"})
    with pytest.raises(ValueError, match="unknown LLaVA-NeXT preset"):
        LlavaNextConfig.preset("llava-13b")


def test_flops_formula_counts_what_runs():
    cfg = LlavaNextConfig.preset("llava-v1.6-vicuna-7b")
    t = cfg.text
    # the Llama part is LlamaConfig's per-layer count plus norms, final norm and lm_head
    s = 2500
    body = t.num_hidden_layers * (t.layer_flops(s) + 2 * 2 * t.hidden_size * s)
    assert llm_forward_flops(cfg, s) == pytest.approx(
        body + 2 * t.hidden_size * s + t.head_flops(s)
    )
    # vision: ~2 x params x tokens for CLIP-L/14 (303M, 23/24 of the blocks) over 577 tokens
    per_tile = vision_forward_flops(cfg, 1)
    assert 0.34e12 < per_tile < 0.40e12
    assert vision_forward_flops(cfg, 5) == pytest.approx(5 * per_tile)
    # training: 3 x forward; a frozen tower counts once; about 6 x 7B x tokens overall
    full = sample_flops(cfg, 5, 2440)
    assert full == pytest.approx(3 * (vision_forward_flops(cfg, 5) + llm_forward_flops(cfg, 2440)))
    frozen = sample_flops(cfg, 5, 2440, vision_trained=False)
    assert full - frozen == pytest.approx(
        2 * (vision_forward_flops(cfg, 5) - 5 * 2 * 576 * (1024 * 4096 + 4096 * 4096 + 2 * 4096))
    )
    assert 0.9 < full / (6 * 6.74e9 * 2440 + 6 * 0.3e9 * 5 * 577) < 1.3
    blocks = LlavaNext.stage_blocks(cfg)
    assert blocks[0].cost == vision_forward_flops(cfg, 5)
