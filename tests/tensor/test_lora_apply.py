"""apply_lora's choice of modules and names, merging, the step FLOPs against what torch counts,
and the base fingerprint across layouts."""

import pytest
import torch

from parallax import ParallelContext, ParallelDims
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.model import LlavaNext
from parallax.families.openvla.lora_flops import openvla_lora_flops
from parallax.families.openvla.model import OpenVLA
from parallax.tensor.fingerprint import base_fingerprint, fingerprint_mismatches
from parallax.tensor.lora_apply import (
    apply_lora,
    merge_lora,
    merged_state,
    remove_lora,
    trainable_parameters,
    unfreeze,
)
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import SEED, make_batch, perturbed_init, tiny_config
from tests.families.openvla.test_lora_model import lora_model

LM = "language_model.model.layers."


def test_targets_select_modules_by_checkpoint_names():
    cfg = tiny_config()
    model = OpenVLA(cfg)
    report = apply_lora(model, ["q_proj", "v_proj", "attn.qkv", "nothing_*"], rank=2)
    assert sorted(report.adapted) == sorted(
        [f"{LM}{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "v_proj")]
        + [
            f"vision_backbone.{t}.blocks.{i}.attn.qkv"
            for t in ("featurizer", "fused_featurizer")
            for i in range(2)
        ]
    )
    assert report.unmatched == ("nothing_*",)
    assert "vision_backbone.fused_featurizer.blocks.2.attn.qkv" in report.skipped
    assert all(n.endswith(("lora_A", "lora_B")) for n, _ in trainable_parameters(model))
    fused = OpenVLA(cfg.with_options(fused_projections=True))
    with pytest.raises(ValueError, match="one fused weight"):
        apply_lora(fused, "q_proj,v_proj")
    report = apply_lora(fused, "language_model.model.*", rank=2)  # parallax names match too
    assert report.adapted[f"{LM}0.self_attn.qkv_proj"] == tuple(
        f"{LM}0.self_attn.{p}_proj" for p in "qkv"
    )
    assert "language_model.lm_head" not in report.adapted and report.skipped == ()
    head = apply_lora(OpenVLA(cfg), ["lm_head"], rank=2)  # named explicitly: adapted
    assert list(head.adapted) == ["language_model.lm_head"]
    everything = apply_lora(OpenVLA(cfg), rank=2)
    assert "language_model.lm_head" not in everything.adapted and len(everything.adapted) == 47
    assert len(everything.skipped) == 13  # 2 x 4 in the towers' third blocks, 5 in attn_pool


def test_unfreeze_selects_whole_modules_or_parameters():
    model = OpenVLA(tiny_config())
    apply_lora(model, rank=2)
    names = unfreeze(model, ["language_model.model.norm", "projector.fc1.bias", "*layernorm*"])
    assert names[:1] == ["projector.fc1.bias"] and "language_model.model.norm.weight" in names
    assert len(names) == 2 + 2 * 4  # two RMSNorms in each of the 4 layers
    assert {n for n, _ in trainable_parameters(model) if ".lora_" not in n} == set(names)


def test_llava_tower_adapters_carry_clip_names():
    """parallax's ViT fuses q/k/v; CLIP stores them apart: three adapters with CLIP's names."""
    cfg = LlavaNextConfig.preset("llava-tiny")
    report = apply_lora(LlavaNext(cfg), rank=2)
    v = "vision_tower.vision_model.encoder.layers."
    assert report.adapted["vision_tower.blocks.0.attn.qkv"] == tuple(
        f"{v}0.self_attn.{p}_proj" for p in "qkv"
    )
    assert report.adapted["vision_tower.blocks.1.attn.proj"] == (f"{v}1.self_attn.out_proj",)
    assert f"{v}2.self_attn.q_proj" in report.skipped  # the layer after the feature layer


def test_dropout_is_refused_at_tp2_and_works_at_tp1():
    fake_tp2 = ParallelContext(dims=ParallelDims(tp=2))  # no groups: fails before any collective
    with pytest.raises(ValueError, match="dropout 0.1 at tp=2"):
        apply_lora(OpenVLA(tiny_config(), fake_tp2), dropout=0.1)
    model = OpenVLA(tiny_config(), seed=0)
    apply_lora(model, rank=2, dropout=0.5)
    for n, p in trainable_parameters(model):
        if n.endswith("lora_B"):
            torch.nn.init.normal_(p)
    px, ids, _ = make_batch(tiny_config())
    model.eval()
    assert torch.equal(model(px, ids), model(px, ids))
    model.train()
    assert not torch.equal(model(px, ids), model(px, ids))


def test_merge_keeps_the_function_and_merged_state_touches_nothing():
    px, ids, _ = make_batch(tiny_config())
    model, _ = lora_model(tiny_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(px, ids).detach()
    state = dict(merged_state(model))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert state.keys() == {n for n in before if ".lora_" not in n}
    assert merge_lora(model) == 47
    assert not any(".lora_" in n for n, _ in model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p.float(), state[n].float()), n
    err = (model(px, ids) - out).abs().max() / out.abs().max()
    assert err < 1e-5
    plain, _ = lora_model(tiny_config())
    assert remove_lora(plain) == 47
    base = OpenVLA(tiny_config())
    base.init_weights(SEED, perturbed_init)
    assert torch.equal(plain(px, ids), base(px, ids))


def _counted_and_formula(targets, fused):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny_config(fused_projections=True) if fused else tiny_config()
    model, _ = lora_model(cfg) if targets == "all-linear" else (OpenVLA(cfg, seed=0), None)
    if targets != "all-linear":
        apply_lora(model, targets, rank=4, alpha=8.0)
    px, ids, labels = make_batch(cfg)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss(model(px, ids), labels).backward()
    meta = OpenVLA(cfg, device="meta")
    apply_lora(meta, targets, rank=4, alpha=8.0)
    flops = px.shape[0] * openvla_lora_flops(meta, ids.shape[1])
    return counter.get_total_flops(), flops, 16 + ids.shape[1]


@pytest.mark.parametrize(
    "targets, fused",
    [("all-linear", False), ("all-linear", True), (["language_model.model.*"], False)],
)
def test_lora_step_flops_count_what_runs(targets, fused):
    """The formula against the FLOPs torch counts in the step (math attention), exact, but for
    the causal half: torch counts the whole score square, the formula half of it (3 x 2 x S^2 x
    h per Llama layer and sample). With the LLM alone adapted, the towers and projector run
    their forward only and the first q/k/v their forward and adapters only."""
    counted, formula, seq = _counted_and_formula(targets, fused)
    assert counted == formula + 2 * 4 * 3 * 2 * seq * seq * 64


def _fingerprints(tp):
    ctx = context(tp=tp)
    model, _ = lora_model(tiny_config(), ctx)
    fp = base_fingerprint(model, ctx)
    with torch.no_grad():  # swap two rows of this rank's slice: the plain sums stay
        w = dict(model.named_parameters())[f"{LM}1.mlp.up_proj.weight"]
        w[[0, 1]] = w[[1, 0]]
    return fp, base_fingerprint(model, ctx)


def test_base_fingerprint_is_layout_free_and_sees_changes():
    ref, _ = _fingerprints_one()
    for fp, moved in run_ranks(_fingerprints, 2, 2):
        assert fingerprint_mismatches(fp, ref) == []
        assert fingerprint_mismatches(moved, ref) == [f"{LM}1.mlp.up_proj.weight"]
    assert not any(".lora_" in n for n in ref) and len(ref) > 100


def _fingerprints_one():
    model, _ = lora_model(tiny_config())
    return base_fingerprint(model), None
