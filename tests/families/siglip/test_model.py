"""The SigLIP and CLIP dual encoders at one process: against a plain reference of the published
architecture on Hugging Face-named weights, presets, config.json, inputs and bad input."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from parallax.families.siglip.checkpoint import expected_tensors
from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.inputs import (
    TinyTextTokenizer,
    pair_batch,
    preprocess_image,
    tokenize,
)
from parallax.families.siglip.model import Siglip
from tests.families.openvla.helpers import assert_rel_close
from tests.families.siglip.helpers import (
    Recorder,
    hf_weights,
    make_pairs,
    reference_image_embeds,
    reference_text_embeds,
    tiny,
)


def write_checkpoint(path, cfg, seed=0) -> dict:
    """A Hugging Face-layout checkpoint of random weights: config.json + model.safetensors."""
    weights = hf_weights(expected_tensors(Siglip(cfg, None, device="meta")), seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    return weights


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_matches_plain_reference(tmp_path, family):
    cfg = tiny(family)
    weights = Recorder(write_checkpoint(tmp_path, cfg))
    model = Siglip.from_pretrained(tmp_path, dtype=torch.float32)
    px, ids = make_pairs(cfg, 3)
    out = model(px, ids)
    with torch.no_grad():
        ref_i = torch.nn.functional.normalize(reference_image_embeds(weights, cfg, px), dim=-1)
        ref_t = torch.nn.functional.normalize(reference_text_embeds(weights, cfg, ids), dim=-1)
    assert_rel_close(out.image_embeds, ref_i, msg="image embeds")
    assert_rel_close(out.text_embeds, ref_t, msg="text embeds")
    weights["logit_scale"]
    if family == "siglip":
        weights["logit_bias"]
        assert out.logit_bias.item() == weights["logit_bias"].item()
    assert out.logit_scale.item() == pytest.approx(float(weights["logit_scale"]))
    assert weights.used == set(weights)  # the reference read every tensor of the checkpoint


def test_preset_sizes():
    """Git-RSCLIP (siglip-large-patch16-256): text 336,194,560 and vision 315,956,224."""
    counts = {}
    for name in ("siglip-large-patch16-256", "siglip-base-patch16-224", "clip-vit-large-patch14"):
        model = Siglip(SiglipConfig.preset(name), device="meta")
        by = {"vision": 0, "text": 0, "logit": 0}
        for n, p in model.named_parameters():
            by[n.split(".")[0].split("_")[0]] += p.numel()
        counts[name] = by
    assert counts["siglip-large-patch16-256"] == {
        "vision": 315_956_224,
        "text": 336_194_560,
        "logit": 2,
    }
    assert sum(counts["siglip-base-patch16-224"].values()) == 203_155_970
    assert sum(counts["clip-vit-large-patch14"].values()) == 427_616_513


def test_hf_config_round_trip():
    for name in ("siglip-large-patch16-256", "siglip-tiny", "clip-vit-large-patch14", "clip-tiny"):
        cfg = SiglipConfig.preset(name)
        back = SiglipConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert (back.vision, back.text, back.family, back.embed_dim) == (
            cfg.vision,
            cfg.text,
            cfg.family,
            cfg.embed_dim,
        ), name
    # a config.json listing only what differs from transformers' defaults (siglip-base)
    base = SiglipConfig.from_dict({"model_type": "siglip", "text_config": {}, "vision_config": {}})
    assert base.vision == SiglipConfig.preset("siglip-base-patch16-224").vision
    with pytest.raises(ValueError, match="model_type"):
        SiglipConfig.from_dict({"model_type": "llama"})


def test_bad_checkpoint_names_every_problem(tmp_path):
    cfg = tiny("siglip")
    weights = write_checkpoint(tmp_path, cfg)
    weights.pop("text_model.head.bias")
    weights["vision_model.head.probe"] = torch.zeros(1, 1, 8)
    weights["vision_model.extra.weight"] = torch.zeros(2)
    weights["text_model.embeddings.position_ids"] = torch.arange(8)[None]  # ignored: a buffer
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        Siglip.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "1 missing tensors: text_model.head.bias" in msg
    assert "vision_model.head.probe has shape [1, 1, 8], expected [1, 1, 16]" in msg
    assert "1 unexpected tensors: vision_model.extra.weight" in msg


def test_bad_inputs_and_pp():
    cfg = tiny("siglip")
    model = Siglip(cfg, seed=0)
    px, ids = make_pairs(cfg, 2)
    with pytest.raises(ValueError, match=r"pixel_values must be \(b, 3, 16, 16\)"):
        model(torch.zeros(2, 3, 32, 32), ids)
    with pytest.raises(ValueError, match="t <= 8"):
        model(px, torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        model(px, ids[:1])

    class PP:
        pp_size = 2

    with pytest.raises(ValueError, match="pipeline parallelism"):
        Siglip(cfg, PP())


def test_tokenize_truncates_and_counts():
    tok = TinyTextTokenizer(bos_id=2)
    ids, truncated = tokenize(tok, ["Hi!", "a" * 20], max_length=8)
    assert truncated == 1
    assert ids[0].tolist() == [2, ord("h"), ord("i"), ord("!"), 1, 1, 1, 1]
    assert ids[1].tolist() == [2] + [ord("a")] * 6 + [1]  # the end token is kept


def test_preprocess_and_pair_batch():
    cfg = tiny("siglip")
    img = np.full((20, 30, 3), 255, dtype=np.uint8)
    x = preprocess_image(img, cfg)
    assert x.shape == (3, 16, 16) and torch.allclose(x, torch.ones_like(x))  # (1 - .5) / .5
    with pytest.raises(ValueError, match="30x20"):
        preprocess_image(img, cfg, strict=True)
    clip = tiny("clip")
    assert preprocess_image(img, clip).shape == (3, 16, 16)  # shortest side, centre crop
    samples = [{"image": img, "caption": "a cat"}, {"image": img, "caption": "x" * 30}]
    px, ids, truncated = pair_batch(samples, cfg, TinyTextTokenizer())
    assert px.shape == (2, 3, 16, 16) and ids.shape == (2, 8) and truncated == 1


def test_sentencepiece_tokenizer(tmp_path):
    """SigLIP's tokenizer path: canonicalised text, pieces, then </s>; padded with </s>."""
    spm = pytest.importorskip("sentencepiece")
    text = [
        "a red ball on the left",
        "the blue square at the top",
        "green triangles everywhere",
    ] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(tmp_path / "spiece"),
        vocab_size=28,
        eos_id=1,
        unk_id=2,
        pad_id=0,
        bos_id=-1,
        minloglevel=2,
    )
    from parallax.families.siglip.inputs import SentencePieceTokenizer

    tok = SentencePieceTokenizer(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spiece.model"))
    assert tok.eos_id == tok.pad_id == 1
    ids, _ = tokenize(tok, ["A  Red, ball!"], 12)
    pieces = sp.encode("a red ball")
    assert ids[0].tolist() == pieces + [1] * (12 - len(pieces))
