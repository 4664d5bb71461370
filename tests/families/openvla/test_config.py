"""OpenVLAConfig from config.json contents, presets, the block list and its partition."""

import json
import math

import pytest
import torch

from parallax.families.openvla.checkpoint import expected_tensors, unused_tensors
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.models import StageBlock, partition

# the shape of openvla-7b's config.json: towers by timm id, a diff-only text_config
HF_CONFIG = {
    "architectures": ["OpenVLAForActionPrediction"],
    "model_type": "openvla",
    "arch_specifier": "no-align+fused-gelu-mlp",
    "use_fused_vision_backbone": True,
    "image_sizes": [224, 224],
    "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None],
    "pad_token_id": 32000,
    "pad_to_multiple_of": 64,
    "n_action_bins": 256,
    "text_config": {"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064},
    "norm_stats": {"bridge_orig": {"action": {"q01": [0.0] * 7, "q99": [1.0] * 7}}},
}


def test_real_config_gives_the_7b_architecture():
    cfg = OpenVLAConfig.from_dict(HF_CONFIG)
    assert cfg.text == OpenVLAConfig.preset("openvla-7b").text
    assert cfg.text.rms_norm_eps == 1e-6  # LlamaConfig() default, what HF inference runs with
    assert (cfg.num_patches, cfg.vision_dim, cfg.tokenizer_vocab_size) == (256, 2176, 32000)
    names = {**expected_tensors(OpenVLA(cfg, None, device="meta")), **unused_tensors(cfg)}
    assert len(names) == 982
    assert sum(math.prod(s) for s in names.values()) == 7_541_237_184
    assert names["vision_backbone.featurizer.pos_embed"] == (1, 256, 1024)
    assert names["projector.fc1.weight"] == (8704, 2176)
    assert names["language_model.lm_head.weight"] == (32064, 4096)
    assert "vision_backbone.fused_featurizer.blocks.26.mlp.fc2.bias" in unused_tensors(cfg)
    assert cfg.to_dict() == HF_CONFIG  # written back unchanged
    assert cfg.action_stats(None)["q99"] == [1.0] * 7


def test_smaller_text_config_and_file_values_win(tmp_path):
    d = json.loads(json.dumps(HF_CONFIG))
    d["text_config"].update(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, rms_norm_eps=1e-5
    )
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = OpenVLAConfig.from_pretrained(tmp_path)
    assert (cfg.text.hidden_size, cfg.text.num_hidden_layers, cfg.text.rms_norm_eps) == (
        256,
        2,
        1e-5,
    )
    model = OpenVLA(cfg, device="meta")
    assert model.language_model.model.norm.eps == 1e-5
    assert list(model.language_model.model.layers) == ["0", "1"]


def test_bad_configs_fail_clearly():
    with pytest.raises(ValueError, match="unknown timm_model_ids"):
        OpenVLAConfig.from_dict({**HF_CONFIG, "timm_model_ids": ["vit_base_patch16_224", "x"]})
    with pytest.raises(ValueError, match="arch_specifier 'gelu-mlp' unsupported"):
        OpenVLAConfig.from_dict({**HF_CONFIG, "arch_specifier": "gelu-mlp"})
    with pytest.raises(ValueError, match="rope_scaling"):
        OpenVLAConfig.from_dict({**HF_CONFIG, "text_config": {"rope_scaling": {"type": "linear"}}})
    with pytest.raises(ValueError, match="unknown OpenVLA preset"):
        OpenVLAConfig.preset("openvla-13b")
    cfg = OpenVLAConfig.from_dict(HF_CONFIG)
    with pytest.raises(ValueError, match="not in norm_stats; choose one of \\['bridge_orig'\\]"):
        cfg.action_stats("libero")


def test_tiny_round_trips_through_config_json():
    tiny = OpenVLAConfig.preset("tiny")
    back = OpenVLAConfig.from_dict(json.loads(json.dumps(tiny.to_dict())))
    assert back.vision == tiny.vision and back.text == tiny.text
    assert (back.tokenizer, back.pad_token_id, back.tokenizer_vocab_size) == ("tiny", 512, 512)
    assert back.image_mean == tiny.image_mean


def test_block_list_and_partition():
    cfg = OpenVLAConfig.preset("openvla-7b")
    blocks = OpenVLA.stage_blocks(cfg)
    assert [b.name for b in blocks] == ["vision"] + [f"llm.{i}" for i in range(32)] + ["head"]
    assert all(isinstance(b, StageBlock) and b.cost > 0 for b in blocks)
    costs = [b.cost for b in blocks]
    for pp in (2, 4, 8):
        stages = partition(costs, pp)
        assert stages[0].start == 0 and stages[-1].stop == 34
        assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
        sizes = [len(r) for r in stages]
        assert sizes[0] < max(sizes[1:])  # the vision stage takes fewer language layers
        loads = [sum(costs[i] for i in r) for r in stages]
        assert max(loads) <= sum(costs) / pp + max(costs)  # balanced to within one block
    assert partition([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 chunks"):
        partition([1, 1, 1], 4)


def test_tiny_training_step_is_fast():
    import time

    from tests.families.openvla.helpers import make_batch, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    model = OpenVLA(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    px, ids, labels = make_batch(cfg, batch=8)
    times = []
    for _ in range(4):
        t = time.perf_counter()
        loss = model.loss(model(px, ids), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    assert min(times) < 1.0, times  # batch 8 of ~94 tokens, one step, CPU
