"""Gemma pieces of one stream of pi0's joint layers: the norms (plain and adaptive), the MLP,
the rotary tables for per-sample positions and one stream's half of a joint layer.

Gemma is not Llama: RMSNorm scales by ``1 + w`` with the statistics in float32, the MLP is a
gelu-tanh GeGLU, and attention is multi-query (one key/value head). Under tp the query heads,
the output projection and the MLP are split (column- then row-parallel); the single key/value
head is replicated on every rank. Its projections are
:class:`~parallax.tensor.replicated.ReplicatedLinear`, whose outputs pass through
``copy_to_tp`` (identity forward, sum over tp backward): each rank's queries see the whole
key, so the gradient reaching it is that rank's share, and summing makes the weights'
gradients (and the input's, and a LoRA adapter's) whole and the same on every rank, as a
replicated parameter's must.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.families.pi0.config import GemmaConfig
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, heads_per_rank, resolve_tp
from parallax.tensor.replicated import ReplicatedLinear


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class GemmaRMSNorm(nn.Module):
    """``rms(x) * (1 + w)`` in float32, cast back to ``x``'s dtype; no gate."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        out = rms(x, self.eps) * (1.0 + self.weight.float())  # (b, s, w)
        return out.to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive norm: ``(scale, shift, gate) = dense(cond)``, then
    ``rms(x) * (1 + scale) + shift``; the gate scales the sublayer's residual."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        if cond is None:
            raise ValueError("an adaptive RMSNorm needs its conditioning (the time embedding)")
        scale, shift, gate = self.dense(cond)[:, None].chunk(3, dim=-1)  # each (b, 1, w)
        out = rms(x, self.eps) * (1.0 + scale.float()) + shift.float()  # (b, s, w)
        return out.to(x.dtype), gate.to(x.dtype)


def make_norm(dim: int, eps: float, adaptive: bool, **kw) -> nn.Module:
    return AdaRMSNorm(dim, eps, **kw) if adaptive else GemmaRMSNorm(dim, eps, **kw)


def gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The residual ``x + y`` (``x + gate * y`` behind an adaptive norm)."""
    return x + y if gate is None else x + y * gate


class GemmaMLP(nn.Module):
    def __init__(self, cfg: GemmaConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        w, f = cfg.width, cfg.mlp_hidden
        kw = dict(bias=False, ctx=ctx, device=device, dtype=dtype)
        self.gate_proj = ColumnParallelLinear(w, f, **kw)
        self.up_proj = ColumnParallelLinear(w, f, **kw)
        self.down_proj = RowParallelLinear(f, w, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")  # (b, s, f/tp)
        return self.down_proj(gate * self.up_proj(x))  # (b, s, w)


class GemmaAttentionProjections(nn.Module):
    """One stream's q, k, v and o (HF names); k and v replicated (module doc)."""

    def __init__(self, cfg: GemmaConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        self.heads = heads_per_rank(cfg.heads, resolve_tp(ctx)[2], "Gemma query heads")
        self.head_dim = cfg.head_dim
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        kw = dict(bias=False, ctx=ctx, device=device, dtype=dtype)
        self.q_proj = ColumnParallelLinear(cfg.width, q, **kw)
        self.k_proj = ReplicatedLinear(cfg.width, kv, **kw)
        self.v_proj = ReplicatedLinear(cfg.width, kv, **kw)
        self.o_proj = RowParallelLinear(q, cfg.width, **kw)

    def qkv(self, x: torch.Tensor, queries: bool = True):
        """``(q (b, nh/tp, s, hd) | None, k, v (b, kv, s, hd))``, before rotary (``queries``:
        whether the queries are wanted)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) if queries else None
        k = self.k_proj(x)  # (b, s, kv hd), whole on every rank
        v = self.v_proj(x)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        return q, k, v


class GemmaStream(nn.Module):
    """One stream's half of a joint layer: ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp`` (HF names); norms adaptive in pi0.5's expert."""

    def __init__(self, cfg: GemmaConfig, ctx, adaptive: bool, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = make_norm(cfg.width, cfg.eps, adaptive, **kw)
        self.self_attn = GemmaAttentionProjections(cfg, ctx, **kw)
        self.post_attention_layernorm = make_norm(cfg.width, cfg.eps, adaptive, **kw)
        self.mlp = GemmaMLP(cfg, ctx, **kw)

    def finish(self, x, attn, gate, cond) -> torch.Tensor:
        """After the joint attention: ``attn`` (b, s, nh/tp hd) -> the layer's output."""
        x = gated(x, self.self_attn.o_proj(attn), gate)  # (b, s, w)
        h, gate = self.post_attention_layernorm(x, cond)
        return gated(x, self.mlp(h), gate)  # (b, s, w)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Rotary tables for per-sample ``positions`` (b, s): each ``(b, 1, s, hd)``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # (b, s, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (b, 1, s, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)
