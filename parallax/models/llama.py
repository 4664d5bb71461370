"""Llama decoder blocks (Llama-2 style: RMSNorm, RoPE, SwiGLU, causal SDPA) on parallax layers.

Names follow Hugging Face ``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.{i}``,
``model.norm``, ``lm_head``) so checkpoints map by name. Layers live in a ``ModuleDict`` keyed by
their global index, and a :class:`LlamaLM` can hold any contiguous range of them with or without
the embedding and the head: a pipeline stage names its parameters exactly as the whole model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallax.models.compile import CheckpointedBlocks, compile_modules, traced_recompute
from parallax.models.llama_config import LlamaConfig
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    heads_per_rank,
    resolve_tp,
)


class RMSNorm(nn.Module):
    """Hugging Face LlamaRMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for ``positions`` (s,) in the rotate-half layout: each ``(s, head_dim)``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (s, hd/2), float32 as HF
    emb = torch.cat([freqs, freqs], dim=-1)  # (s, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin  # (b, nh, s, hd)


class KVCache:
    """Keys and values of the tokens seen so far, per layer (this rank's heads)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def length(self, layer: int) -> int:
        return 0 if layer not in self.keys else self.keys[layer].shape[2]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)  # (b, kv/tp, past + s, hd)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bidirectional SDPA over every position, keys where ``key_mask`` (b, t) is False left
    out (padding): OpenVLA-OFT's parallel decoding. Every query keeps at least its BOS key."""
    if key_mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA where the ``s`` queries are the last ``s`` of the ``t`` keys."""
    s, t = q.shape[2], k.shape[2]
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if s == 1:
        return F.scaled_dot_product_attention(q, k, v)  # one new token sees everything
    mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx, layer: int, device=None, dtype=None) -> None:
        super().__init__()
        tp = resolve_tp(ctx)[2]
        self.layer, self.fused = layer, cfg.fused_projections
        self.heads = heads_per_rank(cfg.num_attention_heads, tp, "Llama attention")
        self.kv_heads = heads_per_rank(cfg.kv_heads, tp, "Llama key/value")
        self.head_dim = cfg.head_dim
        h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
        kw = dict(bias=False, ctx=ctx, device=device, dtype=dtype)
        if self.fused:
            self.qkv_proj = ColumnParallelLinear(h, 3 * h, partitions=3, **kw)
        else:
            self.q_proj = ColumnParallelLinear(h, h, **kw)
            self.k_proj = ColumnParallelLinear(h, kv, **kw)
            self.v_proj = ColumnParallelLinear(h, kv, **kw)
        self.o_proj = RowParallelLinear(h, h, **kw)

    def forward(
        self, x, cos, sin, cache: KVCache | None = None, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``key_mask`` (b, s) bool: attend bidirectionally to the keys it keeps (no cache);
        ``None``: causal attention, as Llama runs."""
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # each (b, s, h/tp)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # -1 heads: the local count, also when a DTensor plan shards the projections
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, nh/tp, s, hd)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv/tp, s, hd)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (b, kv/tp, past + s, hd)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if key_mask is None:
            o = causal_attention(q, k, v)  # (b, nh/tp, s, hd)
        else:
            o = padded_attention(q, k, v, key_mask)  # (b, nh/tp, s, hd)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, h)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(bias=False, ctx=ctx, device=device, dtype=dtype)
        self.fused = cfg.fused_projections
        if self.fused:
            self.gate_up_proj = ColumnParallelLinear(h, 2 * f, partitions=2, **kw)
        else:
            self.gate_proj = ColumnParallelLinear(h, f, **kw)
            self.up_proj = ColumnParallelLinear(h, f, **kw)
        self.down_proj = RowParallelLinear(f, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (b, s, f/tp)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # (b, s, h)


class LlamaDecoderLayer(nn.Module):
    checkpointed = False  # recompute in the backward (activation checkpointing); set by LlamaLM

    def __init__(self, cfg: LlamaConfig, ctx, layer: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(cfg, ctx, layer, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(cfg, ctx, **kw)

    def forward(self, x, cos, sin, cache: KVCache | None = None, key_mask=None) -> torch.Tensor:
        """``key_mask``: see :meth:`LlamaAttention.forward`."""
        if self.checkpointed and cache is None and torch.is_grad_enabled():
            # inside forward, so that a compiled layer traces the recomputation into its own
            # backward graph (which CUDA graphs can replay) instead of calling itself again
            if key_mask is None:
                return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
            return checkpoint(self._forward, x, cos, sin, None, key_mask, use_reentrant=False)
        return self._forward(x, cos, sin, cache, key_mask)

    def _forward(self, x, cos, sin, cache: KVCache | None = None, key_mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``embed_tokens`` (optional), ``layers.{i}`` for ``i`` in ``layers``, ``norm`` (optional)."""

    def __init__(
        self, cfg: LlamaConfig, ctx, layers: range, embed: bool, norm: bool, device, dtype
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if embed:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx=ctx, **kw
            )
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(cfg, ctx, i, **kw) for i in layers})
        if norm:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class LlamaLM(CheckpointedBlocks, nn.Module):
    """A contiguous piece of ``LlamaForCausalLM``: ``model.*`` and, when ``head``, ``lm_head``.

    ``head`` brings the final norm and the vocab-parallel ``lm_head`` whose output is this
    rank's shard of the logits ``(b, s, V/tp)`` (vocabulary padded to a multiple of tp).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        ctx=None,
        *,
        layers: range | None = None,
        embed: bool = True,
        head: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        layers = range(cfg.num_hidden_layers) if layers is None else layers
        self.model = LlamaModel(cfg, ctx, layers, embed, head, device, dtype)
        self._traced_recompute = traced_recompute(ctx)
        self.activation_checkpointing = False
        if head:
            self.lm_head = ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                bias=False,
                pad=True,
                ctx=ctx,
                device=device,
                dtype=dtype,
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # (b, t, h)

    def forward_layers(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        start: int = 0,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this piece's decoder layers on ``x`` (b, s, h) at positions ``start ...``:
        causal, or with ``key_mask`` (b, s) bool bidirectional over the keys it keeps."""
        if not len(self.model.layers):
            return x
        if key_mask is not None and cache is not None:
            raise ValueError("bidirectional attention (a key mask) runs without a KV cache")
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        outside = self._checkpoint_outside and cache is None and torch.is_grad_enabled()
        extra = () if key_mask is None else (None, key_mask)
        for layer in self.model.layers.values():
            if outside:
                x = checkpoint(layer, x, cos, sin, *extra, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache, *extra[1:])
        return x  # (b, s, h)

    def _blocks(self):
        return self.model.layers.values()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))  # (..., V/tp)

    def compile_layers(self, **options) -> None:
        """``torch.compile`` each decoder layer's forward in place
        (:func:`parallax.models.compile.compile_modules`)."""
        compile_modules(self.model.layers.values(), **options)
