"""The tp=1 model against the straightforward reference in helpers.py (float32)."""

import pytest
import torch

from parallax import init_parameters
from parallax.families.openvla.model import OpenVLA
from parallax.models import VisionTransformer, ViTConfig
from tests.families.openvla.helpers import (
    SEED,
    assert_rel_close,
    make_batch,
    perturbed_init,
    ref_loss_and_metrics,
    ref_openvla,
    ref_vit,
    tiny_config,
)


@pytest.mark.parametrize("kv_heads", [None, 2])  # Llama-2's multi-head and grouped-query
def test_tp1_model_matches_reference(kv_heads):
    cfg = tiny_config(num_key_value_heads=kv_heads)
    model = OpenVLA(cfg)
    model.init_weights(SEED, perturbed_init)
    px, ids, labels = make_batch(cfg)
    logits = model(px, ids)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ref = ref_openvla(sd, cfg, px, ids)
    assert logits.shape == (2, cfg.num_patches + ids.shape[1], cfg.text.vocab_size)
    assert_rel_close(logits, ref, msg="logits")
    ref_loss, correct, l1, count = ref_loss_and_metrics(ref, labels, cfg)
    assert_rel_close(model.loss(logits, labels), ref_loss, msg="loss")
    m = model.action_metrics(logits, labels)
    assert m["action_tokens"].item() == count == 2 * 7
    assert m["action_correct"].item() == correct
    assert abs(m["action_l1_sum"].item() - l1) < 1e-5


def test_vit_with_class_token_in_position_embedding_matches_reference():
    # CLIP-style prefix handling (position embedding over class token + patches), no LayerScale
    cfg = ViTConfig(image_size=28, width=24, depth=3, num_heads=3, mlp_hidden=40, feature_layer=1)
    vit = VisionTransformer(cfg)
    init_parameters(vit, SEED, init_fn=perturbed_init)
    images = torch.randn(2, 3, 28, 28)
    ref = ref_vit({k: v.detach() for k, v in vit.state_dict().items()}, "", cfg, images)
    assert_rel_close(vit(images), ref, msg="features")
    assert list(vit.blocks) == ["0", "1"]  # the block after the feature layer is not built
