"""Model FLOPs of OpenVLA training against numbers worked out by hand for the tiny preset, and
the parameter counts they use against the modules the model actually builds."""

import pytest

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.flops import openvla_components, openvla_flops_per_sample
from parallax.families.openvla.model import OpenVLA
from parallax.train.flops import (
    mfu,
    model_tflops_per_gpu,
)

TEXT = 10  # input ids per sample (BOS included): sequence = 16 patches + 10 = 26


def hand_tiny(text: int, logits: int | None = None, frozen: bool = False) -> float:
    """The tiny preset, written out: 56 px images, 14 px patches (16 patches), towers of 3 blocks
    run up to the penultimate (2 blocks each), a 4-layer 64-wide Llama with 576 vocab rows."""
    tower = 1 if frozen else 3  # frozen towers: forward only
    seq = 16 + text
    # DINOv2: width 32, mlp 128, qkv bias, LayerScale; 16 patches + cls + 4 registers = 21 tokens
    dino_block = 2 * 2 * 32 + (3 * 32 * 32 + 96) + (32 * 32 + 32) + (32 * 128 + 128)
    dino_block += (128 * 32 + 32) + 2 * 32
    assert dino_block == 12768
    dino = tower * (2 * 2 * dino_block * 21 + 2 * 4 * 21 * 21 * 32)
    dino += tower * 2 * (3 * 14 * 14 * 32 + 32) * 16  # patch embedding over 16 patches
    # SigLIP: width 48, mlp 184, no prefix tokens, no LayerScale
    siglip_block = 2 * 2 * 48 + (3 * 48 * 48 + 144) + (48 * 48 + 48) + (48 * 184 + 184)
    siglip_block += 184 * 48 + 48
    assert siglip_block == 27496
    siglip = tower * (2 * 2 * siglip_block * 16 + 2 * 4 * 16 * 16 * 48)
    siglip += tower * 2 * (3 * 14 * 14 * 48 + 48) * 16
    # projector 80 -> 320 -> 64 -> 64 over the 16 patches
    projector = 6 * ((80 * 320 + 320) + (320 * 64 + 64) + (64 * 64 + 64)) * 16
    # Llama: 4 layers (2 norms, q k v o 64x64, gate up down 64x176), final norm, causal attention
    layer = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 176
    llama = 6 * (4 * layer + 64) * seq + 3 * 4 * (2 * seq * seq * 64)
    head = 6 * 64 * 576 * (seq if logits is None else logits)
    return dino + siglip + projector + llama + head


def test_tiny_matches_hand_computation():
    cfg = OpenVLAConfig.preset("tiny")
    assert openvla_flops_per_sample(cfg, TEXT) == hand_tiny(TEXT)
    assert openvla_flops_per_sample(cfg, TEXT, logit_positions=8) == hand_tiny(TEXT, 8)
    frozen = openvla_flops_per_sample(cfg, TEXT, frozen_vision=True)
    assert frozen == hand_tiny(TEXT, frozen=True)
    assert frozen < openvla_flops_per_sample(cfg, TEXT)


def test_param_counts_are_the_modules_that_run():
    cfg = OpenVLAConfig.preset("tiny")
    model = OpenVLA(cfg)
    parts = openvla_components(cfg, TEXT)

    def numel(module) -> int:
        return sum(p.numel() for p in module.parameters())

    vb, lm = model.vision_backbone, model.language_model
    assert parts["dinov2.blocks"].params == numel(vb.featurizer.blocks)
    assert parts["dinov2.patch_embed"].params == numel(vb.featurizer.patch_embed)
    assert parts["siglip.blocks"].params == numel(vb.fused_featurizer.blocks)
    assert parts["siglip.patch_embed"].params == numel(vb.fused_featurizer.patch_embed)
    assert parts["projector"].params == numel(model.projector)
    assert parts["llama"].params == numel(lm.model.layers) + numel(lm.model.norm)
    assert parts["lm_head"].params == numel(lm.lm_head)
    ends = ("pos_embed", "cls_token", "reg_token", "embed_tokens.weight")
    lookups = {n for n, _ in model.named_parameters() if n.endswith(ends)}
    counted = sum(c.params for c in parts.values())
    assert counted == sum(p.numel() for n, p in model.named_parameters() if n not in lookups)
    # tokens: 21 for DINOv2 blocks, 16 for SigLIP and the projector, 26 for the Llama
    assert [parts[k].tokens for k in ("dinov2.blocks", "siglip.blocks", "projector", "llama")] == [
        21,
        16,
        16,
        26,
    ]


def test_openvla_7b_scale():
    cfg = OpenVLAConfig.preset("openvla-7b")
    parts = openvla_components(cfg, 41)  # BOS + 40 text tokens: sequence 297
    assert parts["dinov2.blocks"].tokens == 261 and parts["llama"].tokens == 297
    params = sum(c.params for c in parts.values())
    # 7.50 B in the model, less the lookups (embedding 131 M, position embeddings and tokens)
    assert 7.33e9 < params < 7.40e9
    per_sample = openvla_flops_per_sample(cfg, 41)
    assert 6 * params * 256 < per_sample < 6 * params * 297 * 1.1


def test_mfu():
    assert mfu(989e12, 1.0, 1) == pytest.approx(1.0)
    assert mfu(989e12, 2.0, 2) == pytest.approx(0.25)
    assert model_tflops_per_gpu(4e12, 0.5, 2) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="step_time_s"):
        mfu(1e12, 0.0, 1)
    with pytest.raises(ValueError, match="logit_positions"):
        openvla_components(OpenVLAConfig.preset("tiny"), TEXT, logit_positions=100)
