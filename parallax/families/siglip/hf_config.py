"""The Hugging Face ``SiglipConfig`` / ``CLIPConfig`` config.json <-> :class:`SiglipConfig`.

A checkpoint's config.json lists only what differs from the transformers defaults, so the
defaults below (those of ``SiglipTextConfig()``, ``SiglipVisionConfig()``, ``CLIPTextConfig()``
and ``CLIPVisionConfig()``) fill in the rest. Options parallax does not implement fail here,
before any weight is read.
"""

from __future__ import annotations

import copy

from parallax.families.siglip.text_config import (
    CLIP_MEAN,
    CLIP_STD,
    VISION_KIND,
    TextConfig,
    hf_act,
    parallax_act,
)
from parallax.models.vit import ViTConfig
from parallax.models.vit_config import (
    CLIP_VISION_DEFAULTS,
    HF_SIZES,
    sizes_from_hf,
    sizes_to_hf,
)

_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
DEFAULTS = {
    "siglip": {
        "text": {
            **_TOWER,
            "vocab_size": 32000,
            "max_position_embeddings": 64,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "pad_token_id": 1,
        },
        "vision": {
            **_TOWER,
            "image_size": 224,
            "patch_size": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
    },
    "clip": {
        "text": {
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "vocab_size": 49408,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
        },
        "vision": CLIP_VISION_DEFAULTS,
    },
}
CLIP_LEGACY_EOS = 2  # transformers then pools the largest id, the end-of-text token


def _merged(d: dict, family: str, tower: str) -> dict:
    out = dict(DEFAULTS[family][tower])
    out.update({k: v for k, v in (d.get(f"{tower}_config") or {}).items() if v is not None})
    if int(out.get("num_channels", 3)) != 3:
        raise ValueError(f"{tower}_config.num_channels must be 3, got {out['num_channels']}")
    return out


def _vision(v: dict, family: str) -> ViTConfig:
    if family == "siglip" and not v.get("vision_use_head", True):
        raise ValueError("vision_config.vision_use_head=false is not supported (no embedding)")
    common = dict(
        **sizes_from_hf(v),
        act=parallax_act(v["hidden_act"]),
        ln_eps=float(v["layer_norm_eps"]),
    )
    return ViTConfig(**common, **VISION_KIND[family])


def _text(t: dict, family: str) -> TextConfig:
    common = dict(
        vocab_size=int(t["vocab_size"]),
        **sizes_from_hf(t, HF_SIZES),
        max_length=int(t["max_position_embeddings"]),
        act=parallax_act(t["hidden_act"]),
        ln_eps=float(t["layer_norm_eps"]),
    )
    if family == "siglip":  # pads with </s> and pools the last position
        pad = int(t["pad_token_id"])
        return TextConfig(**common, pad_id=pad, eos_id=pad)
    eos = int(t["eos_token_id"])
    if eos == CLIP_LEGACY_EOS:
        top = int(t["vocab_size"]) - 1
        return TextConfig(
            **common, causal=True, pool="argmax", pad_id=top, eos_id=top, bos_id=top - 1
        )
    bos = t.get("bos_token_id")
    return TextConfig(
        **common,
        causal=True,
        pool="eos",
        pad_id=int(t.get("pad_token_id", eos)),
        eos_id=eos,
        bos_id=None if bos is None else int(bos),
    )


def config_from_hf(cls: type, d: dict, source: str | None):
    """``cls`` (:class:`~parallax.families.siglip.config.SiglipConfig`) from a checkpoint's
    config.json, its missing keys filled from the transformers defaults."""
    model_type = d.get("model_type")
    if model_type not in ("siglip", "clip"):
        raise ValueError(
            f"config.json has model_type {model_type!r}: a SigLIP or CLIP dual encoder "
            "('siglip' or 'clip') is needed"
        )
    text, vision = _merged(d, model_type, "text"), _merged(d, model_type, "vision")
    tokenizer = d.get("parallax_tokenizer") or (
        "sentencepiece" if model_type == "siglip" else "tokenizers"
    )
    if model_type == "siglip":
        width = int(vision["hidden_size"])
        if int(text.get("projection_size", width)) != width:
            raise ValueError(
                f"text_config.projection_size {text['projection_size']} must equal the vision "
                f"width {width} (the MAP head's output)"
            )
        return cls(
            vision=_vision(vision, "siglip"),
            text=_text(text, "siglip"),
            tokenizer=tokenizer,
            hf_config=copy.deepcopy(d),
            source=source,
        )
    return cls(
        vision=_vision(vision, "clip"),
        text=_text(text, "clip"),
        family="clip",
        embed_dim=int(d.get("projection_dim", 512)),
        logit_scale_init=float(d.get("logit_scale_init_value", 2.6592)),
        logit_bias_init=None,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        resize="crop",
        tokenizer=tokenizer,
        hf_config=copy.deepcopy(d),
        source=source,
    )


def config_to_hf(config) -> dict:
    """A :class:`~parallax.families.siglip.config.SiglipConfig` as transformers' config.json."""
    v, t = config.vision, config.text
    vision = dict(
        **sizes_to_hf(v),
        hidden_act=hf_act(v.act),
        layer_norm_eps=v.ln_eps,
        num_channels=3,
    )
    text = dict(
        **sizes_to_hf(t, HF_SIZES),
        vocab_size=t.vocab_size,
        max_position_embeddings=t.max_length,
        hidden_act=hf_act(t.act),
        layer_norm_eps=t.ln_eps,
        pad_token_id=t.pad_id,
        eos_token_id=CLIP_LEGACY_EOS if t.pool == "argmax" else t.eos_id,
    )
    if config.family == "siglip":
        d = {"architectures": ["SiglipModel"], "model_type": "siglip"}
        text["projection_size"] = config.embed_dim
    else:
        d = {
            "architectures": ["CLIPModel"],
            "model_type": "clip",
            "projection_dim": config.embed_dim,
            "logit_scale_init_value": config.logit_scale_init,
        }
        vision["projection_dim"] = text["projection_dim"] = config.embed_dim
        if t.pool == "argmax":
            text["bos_token_id"] = 0  # the legacy values that make transformers pool argmax
        elif t.bos_id is not None:
            text["bos_token_id"] = t.bos_id
    d.update(text_config=text, vision_config=vision, torch_dtype="float32")
    if config.tokenizer == "tiny":
        d["parallax_tokenizer"] = "tiny"
    return d
