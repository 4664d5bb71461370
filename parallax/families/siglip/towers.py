"""The two towers of a dual encoder, built from parallax's ViT blocks and tensor layers.

Vision: the :class:`~parallax.models.vit.VisionTransformer` trunk, then SigLIP's attention-pooling
(MAP) head, or CLIP's class token through ``post_layernorm`` and a projection. Text: token and
position embeddings, the same pre-LN blocks (causal for CLIP), a final LayerNorm, one pooled
position and a linear head. Every tower ends in a row-parallel layer that sums over tp, so its
output is the full embedding on every tp rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallax.families.siglip.config import SiglipConfig, TextConfig
from parallax.models.compile import CheckpointedBlocks, compile_modules, traced_recompute
from parallax.models.vit import VisionTransformer, ViTBlock, ViTConfig, ViTMLP
from parallax.tensor import (
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    heads_per_rank,
    resolve_tp,
)
from parallax.tensor.sharding import make_shard


class PoolingAttention(nn.Module):
    """``nn.MultiheadAttention(w, heads, batch_first=True)`` for one query, tensor-parallel.

    The fused ``in_proj_weight`` keeps its Hugging Face name and is split as three blocks
    (q | k | v), each over tp by heads; the query projects only the probe, the keys and values
    only the tokens. ``out_proj`` is row-parallel.
    """

    def __init__(self, cfg: ViTConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        w = cfg.width
        self.group, tp_rank, tp = resolve_tp(ctx)
        self.heads = heads_per_rank(cfg.num_heads, tp, "MAP head attention")
        self.head_dim = w // cfg.num_heads
        info = make_shard(0, 3 * w, tp_rank, tp, partitions=3, what="MAP head in_proj")
        kw = dict(device=device, dtype=dtype)
        self.in_proj_weight = nn.Parameter(torch.empty(info.local_size, w, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(info.local_size, **kw))
        self.in_proj_weight.tp_shard = self.in_proj_bias.tp_shard = info
        self.out_proj = RowParallelLinear(w, w, True, ctx=ctx, **kw)
        if device is None or torch.device(device).type != "meta":
            bound = 1.0 / math.sqrt(w)
            with torch.no_grad():
                self.in_proj_weight.uniform_(-bound, bound)
                self.in_proj_bias.zero_()

    def forward(self, query: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        local = self.heads * self.head_dim
        w, bias = self.in_proj_weight, self.in_proj_bias
        query, x = copy_to_tp(query, self.group), copy_to_tp(x, self.group)
        q = F.linear(query, w[:local], bias[:local])  # (b, 1, w/tp)
        kv = F.linear(x, w[local:], bias[local:])  # (b, n, 2w/tp)
        q = q.view(b, 1, self.heads, self.head_dim).transpose(1, 2)  # (b, nh/tp, 1, hd)
        k, v = kv.view(b, n, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # (b, nh/tp, 1, hd)
        return self.out_proj(o.transpose(1, 2).reshape(b, 1, local))  # (b, 1, w)


class MAPHead(nn.Module):
    """SigLIP's attention pool: a learned probe attends over the tokens, then a residual MLP;
    the output at the probe is the image embedding."""

    def __init__(self, cfg: ViTConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.probe = nn.Parameter(torch.zeros(1, 1, cfg.width, **kw))
        self.attention = PoolingAttention(cfg, ctx, **kw)
        self.layernorm = nn.LayerNorm(cfg.width, eps=cfg.ln_eps, **kw)
        self.mlp = ViTMLP(cfg, ctx, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.probe.expand(x.shape[0], -1, -1), x)  # (b, 1, w)
        h = h + self.mlp(self.layernorm(h))
        return h[:, 0]  # (b, w)


def _projection(in_dim: int, out_dim: int, bias: bool, ctx, **kw) -> RowParallelLinear:
    """A head whose input is replicated and whose output is full on every tp rank."""
    return RowParallelLinear(in_dim, out_dim, bias, input_is_parallel=False, ctx=ctx, **kw)


class VisionTower(nn.Module):
    """Images ``(b, 3, S, S)`` -> unnormalised embeddings ``(b, embed_dim)``."""

    def __init__(self, config: SiglipConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        v = config.vision
        self.family = config.family
        self.trunk = VisionTransformer(v, ctx, **kw)
        if config.family == "siglip":
            self.head = MAPHead(v, ctx, **kw)
        else:
            self.post_layernorm = nn.LayerNorm(v.width, eps=v.ln_eps, **kw)
            self.head = _projection(v.width, config.embed_dim, False, ctx, **kw)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.trunk(pixel_values)  # SigLIP (b, P, w) after post-LN; CLIP (b, 1 + P, w)
        if self.family == "siglip":
            return self.head(x)
        return self.head(self.post_layernorm(x[:, 0]))  # the class token


class TextTower(CheckpointedBlocks, nn.Module):
    """Token ids ``(b, t)``, ``t <= max_length`` -> unnormalised embeddings ``(b, embed_dim)``.

    No attention mask: SigLIP pads every caption to ``max_length`` and reads the last position,
    which sees the whole caption; CLIP reads the end-of-text token, which the causal mask keeps
    from seeing the padding after it.
    """

    def __init__(self, config: SiglipConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        t: TextConfig = config.text
        kw = dict(device=device, dtype=dtype)
        self.cfg = t
        self.token_embedding = VocabParallelEmbedding(t.vocab_size, t.width, ctx=ctx, **kw)
        self.position_embedding = nn.Parameter(torch.zeros(t.max_length, t.width, **kw))
        block = t.block_config()
        self.blocks = nn.ModuleDict({str(i): ViTBlock(block, ctx, **kw) for i in range(t.depth)})
        self.final_layer_norm = nn.LayerNorm(t.width, eps=t.ln_eps, **kw)
        self.head = _projection(t.width, config.embed_dim, config.family == "siglip", ctx, **kw)
        self._traced_recompute = traced_recompute(ctx)
        self.activation_checkpointing = False

    def _blocks(self):
        return self.blocks.values()

    def compile_blocks(self, **options) -> None:
        compile_modules(self.blocks.values(), **options)

    def pool(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The one position per caption that becomes its embedding: ``(b, w)``."""
        if self.cfg.pool == "last":
            return x[:, -1]
        if self.cfg.pool == "argmax":
            index = input_ids.argmax(dim=-1)  # the first largest id: end-of-text
        else:
            index = (input_ids == self.cfg.eos_id).int().argmax(dim=-1)  # first eos
        return x[torch.arange(x.shape[0], device=x.device), index]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.token_embedding(input_ids) + self.position_embedding[:t]  # (b, t, w)
        outside = self._checkpoint_outside and torch.is_grad_enabled()
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if outside else block(x)
        return self.head(self.pool(self.final_layer_norm(x), input_ids))  # (b, d)
