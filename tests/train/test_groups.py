"""Freezing and learning-rate groups, named once for every recipe: ``--lr-groups`` in every form,
and the groups split by learning rate and weight decay."""

import pytest
import torch

from parallax.run import TrainConfig
from parallax.run.param_groups import param_groups, parse_lr_groups


def test_lr_groups_parse_from_every_form(tmp_path):
    want = [("vision_backbone.*", 2e-6), ("*", 2e-5)]
    assert parse_lr_groups("vision_backbone.*=2e-6, *=2e-5") == want
    assert parse_lr_groups({"vision_backbone.*": 2e-6, "*": 2e-5}) == want
    f = tmp_path / "groups.toml"
    f.write_text('[lr_groups]\n"vision_backbone.*" = 2e-6\n"*" = 2e-5\n')
    assert parse_lr_groups(str(f)) == want
    for bad in ("vision=fast", "=1e-3", "vision"):
        with pytest.raises(ValueError, match="--lr-groups"):
            parse_lr_groups(bad)


def test_groups_split_by_lr_and_decay_and_a_fused_weight_cannot_be_half_frozen():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    named = [("vision_backbone.x.weight", w), ("vision_backbone.x.bias", b), ("lm.weight", w)]
    cfg = TrainConfig(lr=1e-3, lr_groups="vision_backbone.*=1e-5")
    groups = param_groups(named, cfg)
    assert [g["lr"] for g in groups] == [1e-5, 1e-5, 1e-3, 1e-3]
    assert [[n for n, _ in g["params"]] for g in groups] == [
        ["vision_backbone.x.weight"],
        ["vision_backbone.x.bias"],
        ["lm.weight"],
        [],
    ]
    fused = [("language_model.model.layers.0.self_attn.qkv_proj.weight", w)]
    with pytest.raises(ValueError, match="--no-fused-projections"):
        param_groups(fused, TrainConfig(lr=1e-3, lr_groups="*q_proj*=1e-5"))
