"""LLaVA-NeXT written as plain torch modules: the torch-native baseline of the LLaVA benchmark.

What a practitioner writes without a training library: ``nn.Linear``/``nn.LayerNorm`` CLIP layers
(the tower stops at the feature layer, the penultimate one) with ``F.scaled_dot_product_attention``,
the mlp2x_gelu projector, the ``image_newline`` parameter, Llama decoder layers (RMSNorm, RoPE,
causal SDPA, SwiGLU) and a full-vocabulary lm_head whose logits go to ``F.cross_entropy``. Parameter
names are llava-hf's, so the benchmark's shared weights load with ``load_state_dict``. AnyRes
packing reuses :func:`parallax.families.llava_next.anyres.pack_image` (pure tensor code, so every
row places the image tokens identically). The best form (``torch.compile`` of each CLIP layer and
decoder layer, fused AdamW, bf16 autocast over fp32 weights, optional activation checkpointing per
layer) is set up in :mod:`benchmarks.step.llava`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig


class ClipLayer(nn.Module):
    def __init__(self, w: int, f: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(w, eps=eps), nn.LayerNorm(w, eps=eps)
        self.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, n, nn.Linear(w, w))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(w, f), nn.Linear(f, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        a = self.layer_norm1(x)
        q, k, v = (
            getattr(self.self_attn, p)(a).view(b, n, self.heads, -1).transpose(1, 2)
            for p in ("q_proj", "k_proj", "v_proj")
        )
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        x = x + self.self_attn.out_proj(o)
        m = self.mlp.fc1(self.layer_norm2(x))
        return x + self.mlp.fc2(m * torch.sigmoid(1.702 * m))  # quick_gelu


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DecoderLayer(nn.Module):
    def __init__(self, h: int, f: int, heads: int, kv: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv = heads, kv
        hd = h // heads
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, h, bias=False)
        self.self_attn.k_proj = nn.Linear(h, kv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, kv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(h, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, f, bias=False)
        self.mlp.up_proj = nn.Linear(h, f, bias=False)
        self.mlp.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        a = self.input_layernorm(x)
        att = self.self_attn
        q = att.q_proj(a).view(b, t, self.heads, -1).transpose(1, 2)
        k = att.k_proj(a).view(b, t, self.kv, -1).transpose(1, 2)
        v = att.v_proj(a).view(b, t, self.kv, -1).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv != self.heads
        )
        x = x + att.o_proj(o.transpose(1, 2).reshape(b, t, h))
        m = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class NativeLlava(nn.Module):
    """LLaVA-NeXT in plain torch (see the module doc); ``forward`` returns the summed
    next-token cross-entropy of the microbatch (the caller divides by the global batch's
    supervised tokens)."""

    def __init__(self, config: LlavaNextConfig) -> None:
        super().__init__()
        self.config, v, t = config, config.vision, config.text
        self.activation_checkpointing = False
        tower = nn.Module()
        tower.embeddings = nn.Module()
        tower.embeddings.class_embedding = nn.Parameter(torch.zeros(v.width))
        tower.embeddings.patch_embedding = nn.Conv2d(
            3, v.width, v.patch_size, v.patch_size, bias=False
        )
        tower.embeddings.position_embedding = nn.Embedding(v.num_patches + 1, v.width)
        tower.pre_layrnorm = nn.LayerNorm(v.width, eps=v.ln_eps)
        tower.encoder = nn.Module()
        tower.encoder.layers = nn.ModuleList(
            ClipLayer(v.width, v.mlp_hidden, v.num_heads, v.ln_eps)
            for _ in range(v.feature_index + 1)
        )
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = tower
        h = t.hidden_size
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(v.width, h)
        self.multi_modal_projector.linear_2 = nn.Linear(h, h)
        self.image_newline = nn.Parameter(torch.zeros(h))
        lm = nn.Module()
        lm.model = nn.Module()
        lm.model.embed_tokens = nn.Embedding(t.vocab_size, h)
        lm.model.layers = nn.ModuleList(
            DecoderLayer(h, t.intermediate_size, t.num_attention_heads, t.kv_heads, t.rms_norm_eps)
            for _ in range(t.num_hidden_layers)
        )
        lm.model.norm = RMSNorm(h, t.rms_norm_eps)
        lm.lm_head = nn.Linear(h, t.vocab_size, bias=False)
        self.language_model = lm

    def layers(self) -> list[nn.Module]:
        """The blocks ``torch.compile`` and activation checkpointing wrap."""
        return [*self.vision_tower.vision_model.encoder.layers, *self.language_model.model.layers]

    def _run(self, layer: nn.Module, *args) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def image_tokens(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        cfg, tower = self.config, self.vision_tower.vision_model
        sizes = [tuple(s) for s in image_sizes.tolist()]
        tiles = [anyres.num_tiles(s, cfg.image_grid_pinpoints, cfg.tile_size) for s in sizes]
        x = torch.cat([pixel_values[i, :n] for i, n in enumerate(tiles)])
        x = tower.embeddings.patch_embedding(x).flatten(2).transpose(1, 2)  # (N, P, w)
        cls = tower.embeddings.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], 1) + tower.embeddings.position_embedding.weight
        x = tower.pre_layrnorm(x)
        for layer in tower.encoder.layers:
            x = self._run(layer, x)
        proj = self.multi_modal_projector
        feats = proj.linear_2(F.gelu(proj.linear_1(x[:, 1:])))  # (N, P, h)
        out, start = [], 0
        for size, n in zip(sizes, tiles):
            part = feats[start : start + n]
            out.append(
                anyres.pack_image(
                    part, size, cfg.image_grid_pinpoints, cfg.tile_size, self.image_newline
                )
            )
            start += n
        return torch.cat(out)

    def forward(self, pixel_values, input_ids, image_sizes, labels) -> torch.Tensor:
        lm = self.language_model.model
        x = lm.embed_tokens(input_ids)
        feats = self.image_tokens(pixel_values, image_sizes).to(x.dtype)
        mask = (input_ids == self.config.image_token_index).unsqueeze(-1)
        x = x.masked_scatter(mask, feats)
        t, hd = input_ids.shape[1], self.config.text.head_dim
        inv = 1.0 / self.config.text.rope_theta ** (
            torch.arange(0, hd, 2, device=x.device).float() / hd
        )
        ang = torch.outer(torch.arange(t, device=x.device).float(), inv)
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in lm.layers:
            x = self._run(layer, x, cos, sin)
        logits = self.language_model.lm_head(lm.norm(x))  # (b, t, V)
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
        )
