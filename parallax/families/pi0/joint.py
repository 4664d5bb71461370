"""pi0's joint layer: the prefix model and the action expert attend in one softmax.

Each stream normalises its own tokens and applies its own q, k, v; the streams' queries, keys
and values are concatenated along the sequence (prefix first) and attend under one additive
mask (:func:`joint_layout`); the output is split back and each stream applies its own output
projection, residual, norm and MLP. Either stream may be absent: the prefix alone fills a
:class:`PrefixCache` once, and the expert alone then attends over the cached prefix at every
Euler step of inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.families.pi0.config import MASK_VALUE, Pi0Config
from parallax.families.pi0.gemma import GemmaStream
from parallax.models.llama import apply_rope


class PrefixCache:
    """The prefix's keys and values per layer (rotary applied; this rank's copy of the one
    key/value head), its padding mask and its real length per sample."""

    def __init__(self, pad: torch.Tensor) -> None:
        self.pad = pad  # (b, P) bool
        self.filling = True
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.suffix_allowed: torch.Tensor | None = None  # (b, S, P + S): what the suffix sees
        self.suffix_positions: torch.Tensor | None = None  # (b, S)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """While filling, keep ``k, v``; afterwards, the cached prefix followed by ``k, v``
        (the cache itself unchanged, so every Euler step sees the same prefix)."""
        if self.filling:
            self.keys[layer], self.values[layer] = k, v
            return k, v
        k = torch.cat([self.keys[layer], k], dim=2)  # (b, kv, P + s, hd)
        v = torch.cat([self.values[layer], v], dim=2)
        return k, v


def joint_layout(prefix_pad: torch.Tensor, suffix_flags: torch.Tensor):
    """``(allowed (b, T, T) bool, positions (b, T))`` of the joint sequence: the prefix's
    padding mask ``(b, P)`` with block flags 0, then the suffix's tokens (all real) with
    ``suffix_flags`` ``(S,)``. With ``c`` the running sum of the flags, query i sees key j
    when ``c[j] <= c[i]`` and both are real; positions count the real tokens, minus one."""
    b = prefix_pad.shape[0]
    s = suffix_flags.shape[0]
    pad = torch.cat([prefix_pad, prefix_pad.new_ones(b, s)], dim=1)  # (b, T)
    flags = torch.cat([prefix_pad.new_zeros(prefix_pad.shape[1], dtype=torch.long), suffix_flags])
    c = flags.cumsum(0)  # (T,)
    blocks = c[None, :] <= c[:, None]  # (T, T): query row, key column
    allowed = blocks[None] & pad[:, None, :] & pad[:, :, None]  # (b, T, T)
    positions = pad.long().cumsum(1) - 1  # (b, T)
    return allowed, positions


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``(b, 1, q, k)``: 0 where allowed, openpi's finite mask value
    elsewhere (a fully masked row attends uniformly instead of giving NaN)."""
    zero = torch.zeros((), dtype=torch.float32, device=allowed.device)
    return torch.where(allowed, zero, MASK_VALUE).to(dtype)[:, None]


def joint_attention(q, k, v, bias: torch.Tensor) -> torch.Tensor:
    """Multi-query attention: ``q`` (b, nh/tp, s, hd), one key/value head ``k, v``
    (b, 1, t, hd) shared by every query head; scale ``hd^-0.5``."""
    if k.shape[1] != 1:
        raise ValueError(f"pi0's joint attention takes one key/value head, got {k.shape[1]}")
    k = k.expand(-1, q.shape[1], -1, -1)  # (b, nh/tp, t, hd)
    v = v.expand(-1, q.shape[1], -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (b, nh/tp, s, hd)


class JointLayer(nn.Module):
    """Layer ``layer`` of both streams (``prefix``, ``expert``: HF layer names below them)."""

    def __init__(self, config: Pi0Config, ctx, layer: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.layer = layer
        self.prefix = GemmaStream(config.prefix, ctx, False, **kw)
        self.expert = GemmaStream(config.expert, ctx, config.pi05, **kw)

    def forward(self, xs, cos, sin, bias, cond=None, cache=None, outputs=(True, True)):
        """``xs``: ``(prefix (b, P, w_p) | None, suffix (b, S, w_e) | None)``; ``cos, sin``
        (b, 1, s, hd) and ``bias`` (b, 1, s, t) over the present tokens (``t`` includes a
        cached prefix); ``cond`` (b, w_e): pi0.5's time conditioning; ``outputs``: which
        streams' outputs are wanted (the last layer's prefix output is not)."""
        streams = ((self.prefix, None), (self.expert, cond))
        present = [(i, s, xs[i], c) for i, (s, c) in enumerate(streams) if xs[i] is not None]
        qs, ks, vs, gates = [], [], [], []
        for i, stream, x, c in present:
            h, gate = stream.input_layernorm(x, c)
            # unwanted queries would reach nothing: not computed
            q, k, v = stream.self_attn.qkv(h, outputs[i])  # (b, nh/tp, s_i, hd), (b, 1, s_i, hd)
            ks, vs, gates = ks + [k], vs + [v], gates + [gate]
            qs += [q] if outputs[i] else []
        k = apply_rope(torch.cat(ks, dim=2), cos, sin)  # (b, 1, s, hd)
        v = torch.cat(vs, dim=2)
        if cache is not None:
            k, v = cache.extend(self.layer, k, v)  # (b, 1, t, hd)
        out: list[torch.Tensor | None] = [None, None]
        if not qs:
            return tuple(out)
        skip = xs[0].shape[1] if xs[0] is not None and not outputs[0] else 0
        q = apply_rope(torch.cat(qs, dim=2), cos[:, :, skip:], sin[:, :, skip:])
        o = joint_attention(q, k, v, bias[:, :, skip:])  # (b, nh/tp, s - skip, hd)
        o = o.transpose(1, 2).flatten(2)  # (b, s - skip, nh/tp hd)
        wanted = [(i, st, x, c, g) for (i, st, x, c), g in zip(present, gates) if outputs[i]]
        parts = o.split([x.shape[1] for _, _, x, _, _ in wanted], dim=1)
        for (i, stream, x, c, gate), attn in zip(wanted, parts):
            out[i] = stream.finish(x, attn, gate, c)  # (b, s_i, w_i)
        return tuple(out)
