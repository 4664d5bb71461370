"""Shared pieces of the LLaVA-NeXT tests: a tiny config, a batch of mixed image sizes and a
text-only sample, and a plain single-process LLaVA-NeXT written from the published architecture
(CLIP encoder, mlp2x_gelu, AnyRes packing with unpadding and the newline column, Llama) on a dict
of llava-hf-named tensors, with no parallax code."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.processor import LlavaNextProcessor
from tests.families.openvla.helpers import _rms, _rotate, _softmax_attention

SEED = 1234
V = "vision_tower.vision_model."
LM = "language_model.model."
# (height, width): 5 tiles / 24 tokens, 4 tiles / 22 tokens (models.md 3.3), 5 tiles with a
# cropped map, and 4 tiles of a wide image; plus a text-only sample
IMAGE_SIZES = [(30, 40), (60, 20), (56, 30), (20, 80), None]


def tiny_config(vocab: int = 131, **text) -> LlavaNextConfig:
    """llava-tiny with a vocabulary that tp=2 must pad (131 rows: 128 text, <image>, <pad>, one
    spare) unless ``vocab`` says otherwise."""
    cfg = LlavaNextConfig.preset("llava-tiny")
    return replace(cfg, text=replace(cfg.text, vocab_size=vocab, **text))


def make_batch(cfg: LlavaNextConfig, sizes=IMAGE_SIZES, seed: int = 0) -> dict:
    """The processor's batch for images of ``sizes`` (None: text only) with short questions."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, size in enumerate(sizes):
        image = (
            None if size is None else torch.randint(0, 256, (*size, 3), generator=g).to(torch.uint8)
        )
        q = ("<image>\n" if image is not None else "") + f"What is in {i}?"
        a = ["a cat", "two dogs", "red", "a long answer here", "hello"][i % 5]
        samples.append(
            {
                "id": i,
                "image": image,
                "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
            }
        )
    return LlavaNextProcessor(cfg)(samples)


def hf_tensors(cfg: LlavaNextConfig, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors under the llava-hf names and shapes (models.md 1.4), every layer of the
    tower included, scaled so that every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    v, t = cfg.vision, cfg.text
    w, f, h = v.width, v.mlp_hidden, t.hidden_size
    shapes = {
        V + "embeddings.class_embedding": (w,),
        V + "embeddings.patch_embedding.weight": (w, 3, v.patch_size, v.patch_size),
        V + "embeddings.position_embedding.weight": (v.num_patches + 1, w),
        V + "pre_layrnorm.weight": (w,),
        V + "pre_layrnorm.bias": (w,),
        V + "post_layernorm.weight": (w,),
        V + "post_layernorm.bias": (w,),
        "multi_modal_projector.linear_1.weight": (h, w),
        "multi_modal_projector.linear_1.bias": (h,),
        "multi_modal_projector.linear_2.weight": (h, h),
        "multi_modal_projector.linear_2.bias": (h,),
        "image_newline": (h,),
        LM + "embed_tokens.weight": (t.vocab_size, h),
        LM + "norm.weight": (h,),
        "language_model.lm_head.weight": (t.vocab_size, h),
    }
    for i in range(v.depth):
        p = f"{V}encoder.layers.{i}."
        for n in ("q", "k", "v", "out"):
            shapes.update(
                {p + f"self_attn.{n}_proj.weight": (w, w), p + f"self_attn.{n}_proj.bias": (w,)}
            )
        for n in ("layer_norm1", "layer_norm2"):
            shapes.update({p + n + ".weight": (w,), p + n + ".bias": (w,)})
        shapes.update(
            {
                p + "mlp.fc1.weight": (f, w),
                p + "mlp.fc1.bias": (f,),
                p + "mlp.fc2.weight": (w, f),
                p + "mlp.fc2.bias": (w,),
            }
        )
    kv = t.kv_heads * t.head_dim
    for i in range(t.num_hidden_layers):
        p = f"{LM}layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (t.intermediate_size, h),
                p + "mlp.up_proj.weight": (t.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, t.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        if name.endswith("bias"):
            x = 0.05 * x
        elif len(shape) == 1 and "norm" in name:
            x = 1.0 + 0.1 * x
        elif len(shape) > 1:
            x = x / math.sqrt(math.prod(shape[1:]))
        out[name] = x.to(torch.bfloat16).float()  # values a bf16 checkpoint holds exactly
    return out


# ---------------------------------------------------------------------------- the reference


def _ln(x, sd, p, eps):
    return F.layer_norm(x, (x.shape[-1],), sd[p + ".weight"], sd[p + ".bias"], eps)


def ref_clip(sd: dict, cfg, tiles: torch.Tensor) -> torch.Tensor:
    """CLIPVisionModel's ``hidden_states[vision_feature_layer]`` without CLS: (n, P, w)."""
    v = cfg.vision
    x = F.conv2d(tiles, sd[V + "embeddings.patch_embedding.weight"], stride=v.patch_size)
    x = x.flatten(2).transpose(1, 2)
    n = x.shape[0]
    cls = sd[V + "embeddings.class_embedding"].expand(n, 1, -1)
    x = torch.cat([cls, x], 1) + sd[V + "embeddings.position_embedding.weight"]
    states = [_ln(x, sd, V + "pre_layrnorm", v.ln_eps)]
    heads, hd = v.num_heads, v.width // v.num_heads
    for i in range(v.depth):
        p = f"{V}encoder.layers.{i}."
        x = states[-1]
        a = _ln(x, sd, p + "layer_norm1", v.ln_eps)
        q, k, val = (
            F.linear(a, sd[p + f"self_attn.{c}_proj.weight"], sd[p + f"self_attn.{c}_proj.bias"])
            .view(n, -1, heads, hd)
            .transpose(1, 2)
            for c in "qkv"
        )
        o = _softmax_attention(q, k, val, causal=False).transpose(1, 2).reshape(n, -1, v.width)
        x = x + F.linear(o, sd[p + "self_attn.out_proj.weight"], sd[p + "self_attn.out_proj.bias"])
        m = F.linear(
            _ln(x, sd, p + "layer_norm2", v.ln_eps),
            sd[p + "mlp.fc1.weight"],
            sd[p + "mlp.fc1.bias"],
        )
        m = m * torch.sigmoid(1.702 * m)
        states.append(x + F.linear(m, sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"]))
    return states[v.feature_layer][:, 1:]


def ref_best_canvas(size, pinpoints):
    """transformers' select_best_resolution, restated."""
    h, w = size
    scored = []
    for ph, pw in pinpoints:
        s = min(pw / w, ph / h)
        eff = min(int(w * s) * int(h * s), w * h)
        scored.append((-eff, ph * pw - eff, (ph, pw)))
    return min(scored, key=lambda x: (x[0], x[1]))[2]  # first among equals, as a strict > keeps


def ref_unpad(feature: torch.Tensor, size) -> torch.Tensor:
    """transformers' unpad_image on (C, H, W)."""
    h, w = size
    _, ch, cw = feature.shape
    if w / h > cw / ch:
        new = int(round(h * (cw / w), 7))
        pad = (ch - new) // 2
        return feature[:, pad : ch - pad, :]
    new = int(round(w * (ch / h), 7))
    pad = (cw - new) // 2
    return feature[:, :, pad : cw - pad]


def ref_pack(feats: torch.Tensor, size, cfg, newline) -> torch.Tensor:
    """transformers' pack_image_features for one image: (n_tiles, P, C) -> (tokens, C)."""
    side = cfg.tile_side
    ph, pw = ref_best_canvas(size, cfg.image_grid_pinpoints)
    gh, gw = ph // cfg.tile_size, pw // cfg.tile_size
    base, grid = feats[0], feats[1:]
    grid = grid.view(gh, gw, side, side, -1).permute(4, 0, 2, 1, 3).contiguous()
    grid = grid.flatten(1, 2).flatten(2, 3)  # (C, gh * side, gw * side)
    grid = ref_unpad(grid, size)
    grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
    return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)], dim=0)


def ref_llava(sd: dict, cfg, pixel_values, input_ids, image_sizes) -> torch.Tensor:
    """Full logits ``(b, t, V)`` of LLaVA-NeXT."""
    emb = sd[LM + "embed_tokens.weight"][input_ids].clone()  # (b, t, h)
    for i, size in enumerate(image_sizes.tolist()):
        if size == [0, 0]:
            continue
        ph, pw = ref_best_canvas(size, cfg.image_grid_pinpoints)
        n = 1 + (ph // cfg.tile_size) * (pw // cfg.tile_size)
        x = ref_clip(sd, cfg, pixel_values[i, :n])
        x = F.linear(
            x,
            sd["multi_modal_projector.linear_1.weight"],
            sd["multi_modal_projector.linear_1.bias"],
        )
        x = F.linear(
            F.gelu(x),
            sd["multi_modal_projector.linear_2.weight"],
            sd["multi_modal_projector.linear_2.bias"],
        )
        tokens = ref_pack(x, size, cfg, sd["image_newline"])
        where = (input_ids[i] == cfg.image_token_index).nonzero().flatten()
        assert len(where) == len(tokens)
        emb[i, where] = tokens
    return ref_llama(sd, cfg.text, emb)


def ref_llama(sd: dict, t, h: torch.Tensor) -> torch.Tensor:
    b, s, _ = h.shape
    pos = torch.arange(s)
    for i in range(t.num_hidden_layers):
        p = f"{LM}layers.{i}."
        a = _rms(h, sd[p + "input_layernorm.weight"], t.rms_norm_eps)
        q, k, v = (
            F.linear(a, sd[p + f"self_attn.{n}_proj.weight"])
            .view(b, s, -1, t.head_dim)
            .transpose(1, 2)
            for n in "qkv"
        )
        q, k = _rotate(q, pos, t.rope_theta), _rotate(k, pos, t.rope_theta)
        o = _softmax_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, -1)
        h = h + F.linear(o, sd[p + "self_attn.o_proj.weight"])
        a = _rms(h, sd[p + "post_attention_layernorm.weight"], t.rms_norm_eps)
        gate, up = (
            F.linear(a, sd[p + "mlp.gate_proj.weight"]),
            F.linear(a, sd[p + "mlp.up_proj.weight"]),
        )
        h = h + F.linear(F.silu(gate) * up, sd[p + "mlp.down_proj.weight"])
    h = _rms(h, sd[LM + "norm.weight"], t.rms_norm_eps)
    return F.linear(h, sd["language_model.lm_head.weight"])


def ref_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
