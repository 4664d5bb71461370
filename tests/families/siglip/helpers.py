"""Shared pieces of the dual-encoder tests: tiny configs, an init that makes every parameter
matter, inputs, Hugging Face-named random weights, and plain single-process references of the
SigLIP and CLIP towers written from the published architecture (plain tensor ops on a dict of
Hugging Face-named weights; the MAP head through ``torch.nn.MultiheadAttention``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from parallax.families.siglip.config import SiglipConfig, TextConfig
from parallax.models.vit import ViTConfig

SEED = 4321


def tiny_siglip() -> SiglipConfig:
    vision = ViTConfig(
        image_size=16,
        patch_size=8,
        width=16,
        depth=2,
        num_heads=2,
        mlp_hidden=24,
        class_token=False,
        act="gelu_tanh",
        final_norm=True,
        pool="map",
    )
    text = TextConfig(vocab_size=64, width=16, depth=2, num_heads=2, mlp_hidden=24, max_length=8)
    return SiglipConfig(vision=vision, text=text, tokenizer="tiny")


def tiny_clip() -> SiglipConfig:
    vision = ViTConfig(
        image_size=16,
        patch_size=8,
        width=16,
        depth=2,
        num_heads=2,
        mlp_hidden=24,
        class_token=True,
        act="quick_gelu",
        ln_eps=1e-5,
        pre_norm=True,
        keep_prefix=True,
        patch_bias=False,
    )
    text = TextConfig(
        vocab_size=64,
        width=16,
        depth=2,
        num_heads=2,
        mlp_hidden=24,
        max_length=8,
        act="quick_gelu",
        ln_eps=1e-5,
        causal=True,
        pool="eos",
        eos_id=1,
        pad_id=1,
        bos_id=2,
    )
    return SiglipConfig(
        vision=vision,
        text=text,
        family="clip",
        embed_dim=12,
        logit_scale_init=2.6592,
        logit_bias_init=None,
        resize="crop",
        tokenizer="tiny",
    )


def tiny(family: str) -> SiglipConfig:
    return tiny_siglip() if family == "siglip" else tiny_clip()


def perturbed_init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
    """Random values everywhere (norms around 1, biases non-zero, logit scale and bias near
    their starting values), so a wrong bias, norm or scale shows in the embeddings."""
    x = torch.empty(shape, device=device).normal_(0.0, 1.0, generator=gen)
    if name == "logit_scale":
        return math.log(10.0) + 0.1 * x
    if name == "logit_bias":
        return -2.0 + 0.1 * x
    if name.endswith("bias"):
        return 0.05 * x
    if len(shape) == 1:
        return 1.0 + 0.1 * x
    if name.endswith(("pos_embed", "position_embedding", "probe", "cls_token", "embedding.weight")):
        return 0.5 * x
    return x / math.sqrt(math.prod(shape[1:]))


def make_pairs(config: SiglipConfig, n: int, seed: int = 0):
    """``pixel_values (n, 3, S, S)`` and ``input_ids (n, L)``: random ids, each caption ending
    in the end token at a different place, padding after it (what the tokenizers produce)."""
    g = torch.Generator().manual_seed(seed)
    s, t = config.image_size, config.text
    px = torch.randn(n, 3, s, s, generator=g)
    ids = torch.randint(3, t.vocab_size, (n, t.max_length), generator=g)
    for i in range(n):
        end = 2 + (i % (t.max_length - 2))
        ids[i, end] = t.eos_id
        ids[i, end + 1 :] = t.pad_id
        if t.bos_id is not None:
            ids[i, 0] = t.bos_id
    return px, ids


def hf_weights(names_shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Hugging Face-named tensors of the given shapes, scaled like :func:`perturbed_init`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(names_shapes.items()):
        x = torch.randn(shape, generator=g)
        if name == "logit_scale":
            x = math.log(10.0) + 0.1 * x
        elif name == "logit_bias":
            x = -2.0 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.05 * x
        elif "norm" in name and name.endswith("weight"):
            x = 1.0 + 0.1 * x
        elif len(shape) < 2 or "embedding" in name or name.endswith("probe"):
            x = 0.5 * x
        else:
            x = x / math.sqrt(math.prod(shape[1:]))
        out[name] = x.contiguous()
    return out


# ---------------------------------------------------------------------------- the reference


class Recorder(dict):
    """A dict that remembers which keys were read: the reference must use every tensor."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.used: set[str] = set()

    def __getitem__(self, key):
        self.used.add(key)
        return super().__getitem__(key)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":  # gelu_pytorch_tanh
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x * torch.sigmoid(1.702 * x)  # quick_gelu


def _ln(w, prefix: str, x, eps: float):
    return F.layer_norm(x, x.shape[-1:], w[f"{prefix}.weight"], w[f"{prefix}.bias"], eps)


def _lin(w, prefix: str, x, bias: bool = True):
    return F.linear(x, w[f"{prefix}.weight"], w[f"{prefix}.bias"] if bias else None)


def _encoder_layer(w, p: str, x, heads: int, act: str, eps: float, causal: bool):
    """A CLIP / SigLIP encoder layer: pre-LN attention and MLP, softmax written out."""
    b, n, d = x.shape
    h = _ln(w, f"{p}.layer_norm1", x, eps)
    q, k, v = (
        _lin(w, f"{p}.self_attn.{c}_proj", h).view(b, n, heads, -1).transpose(1, 2) for c in "qkv"
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // heads)  # (b, nh, n, n)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
    x = x + _lin(w, f"{p}.self_attn.out_proj", o)
    h = _ln(w, f"{p}.layer_norm2", x, eps)
    return x + _lin(w, f"{p}.mlp.fc2", _act(act, _lin(w, f"{p}.mlp.fc1", h)))


def reference_image_embeds(w, cfg: SiglipConfig, px: torch.Tensor) -> torch.Tensor:
    v, pre = cfg.vision, "vision_model"
    x = F.conv2d(
        px,
        w[f"{pre}.embeddings.patch_embedding.weight"],
        w[f"{pre}.embeddings.patch_embedding.bias"] if cfg.family == "siglip" else None,
        stride=v.patch_size,
    )
    x = x.flatten(2).transpose(1, 2)  # (b, patches, w), row-major
    if cfg.family == "clip":
        cls = w[f"{pre}.embeddings.class_embedding"].expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1)
    x = x + w[f"{pre}.embeddings.position_embedding.weight"]
    if cfg.family == "clip":
        x = _ln(w, f"{pre}.pre_layrnorm", x, v.ln_eps)
    for i in range(v.depth):
        x = _encoder_layer(w, f"{pre}.encoder.layers.{i}", x, v.num_heads, v.act, v.ln_eps, False)
    if cfg.family == "clip":
        pooled = _ln(w, f"{pre}.post_layernorm", x[:, 0], v.ln_eps)
        return F.linear(pooled, w["visual_projection.weight"])
    x = _ln(w, f"{pre}.post_layernorm", x, v.ln_eps)
    mha = torch.nn.MultiheadAttention(v.width, v.num_heads, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(w[f"{pre}.head.attention.in_proj_weight"])
        mha.in_proj_bias.copy_(w[f"{pre}.head.attention.in_proj_bias"])
        mha.out_proj.weight.copy_(w[f"{pre}.head.attention.out_proj.weight"])
        mha.out_proj.bias.copy_(w[f"{pre}.head.attention.out_proj.bias"])
    probe = w[f"{pre}.head.probe"].expand(x.shape[0], -1, -1)
    h = mha(probe, x, x, need_weights=False)[0]
    y = _ln(w, f"{pre}.head.layernorm", h, v.ln_eps)
    y = _lin(w, f"{pre}.head.mlp.fc2", _act(v.act, _lin(w, f"{pre}.head.mlp.fc1", y)))
    return (h + y)[:, 0]


def reference_text_embeds(w, cfg: SiglipConfig, ids: torch.Tensor) -> torch.Tensor:
    t, pre = cfg.text, "text_model"
    x = F.embedding(ids, w[f"{pre}.embeddings.token_embedding.weight"])
    x = x + w[f"{pre}.embeddings.position_embedding.weight"][: ids.shape[1]]
    for i in range(t.depth):
        x = _encoder_layer(
            w, f"{pre}.encoder.layers.{i}", x, t.num_heads, t.act, t.ln_eps, t.causal
        )
    x = _ln(w, f"{pre}.final_layer_norm", x, t.ln_eps)
    if cfg.family == "siglip":  # last position, then the head
        return _lin(w, f"{pre}.head", x[:, -1])
    first_eos = torch.tensor([row.tolist().index(t.eos_id) for row in ids])
    return F.linear(x[torch.arange(ids.shape[0]), first_eos], w["text_projection.weight"])


def reference_loss(family: str, x, y, scale, bias):
    """The single-process losses, written densely from their definitions (models.md 2.3)."""
    x, y = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
    logits = scale.exp() * x @ y.T
    n = x.shape[0]
    if family == "siglip":
        z = 2 * torch.eye(n) - 1
        return -F.logsigmoid(z * (logits + bias)).sum(dim=1).mean()
    labels = torch.arange(n)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
