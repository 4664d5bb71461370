"""Pi0Model: pi0 and pi0.5 on parallax layers (``shared/pi0.md``).

The prefix is every camera's SigLIP patches through the projector, then the prompt's token
embeddings times ``sqrt(width)``; the suffix is the expert's tokens (:mod:`.suffix`). Every
layer is joint (:mod:`.joint`). Training runs both streams at once (:meth:`Pi0Model.velocity`);
inference fills a :class:`~.joint.PrefixCache` once (:meth:`Pi0Model.fill_cache`) and runs the
expert alone over it at every Euler step (:meth:`Pi0Model.cached_velocity`).

Module names: ``vision`` (parallax's ViT, timm names), ``projector``, ``embed_tokens``,
``layers.{i}.{prefix,expert}.*`` (HF Gemma names below), ``norm`` (the prefix model's final
norm: in LeRobot's checkpoint, never reaching the actions), ``expert_norm`` and the suffix heads
at the top level; :mod:`.checkpoint` maps them to LeRobot's keys. The last layer's prefix
stream after its keys and values never reaches the actions either: :meth:`unused_names` lists
those parameters (they get no gradient).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.gemma import GemmaRMSNorm, make_norm, rope_tables
from parallax.families.pi0.joint import JointLayer, PrefixCache, attention_bias, joint_layout
from parallax.families.pi0.suffix import add_heads, embed_suffix, suffix_flags
from parallax.init import InitFn, init_parameters
from parallax.models.vit import VisionTransformer
from parallax.tensor import VocabParallelEmbedding


def pi0_init_fn() -> InitFn:
    """Layout-free init: N(0, 1/fan_in) for matrices, convolutions and embeddings (fan-in: the
    product of the trailing dims), zeros for biases; 1-D weights keep their module's constant
    (Gemma norms 0, as they scale by ``1 + w``; LayerNorms 1)."""

    def init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor | None:
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if len(shape) < 2:
            return None
        std = math.prod(shape[1:]) ** -0.5
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return init


class Pi0Model(nn.Module):
    """A whole pi0 / pi0.5 policy network on this rank (module doc); ``seed``: the layout-free
    init (else the layers' own)."""

    def __init__(
        self,
        config: Pi0Config,
        ctx=None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        kw = dict(device=device, dtype=dtype)
        p, e = config.prefix, config.expert
        self.vision = VisionTransformer(config.vision, ctx, **kw)
        self.projector = nn.Linear(config.vision.width, p.width, **kw)
        self.embed_tokens = VocabParallelEmbedding(p.vocab_size, p.width, ctx=ctx, **kw)
        layers = {str(i): JointLayer(config, ctx, i, **kw) for i in range(config.depth)}
        self.layers = nn.ModuleDict(layers)
        self.norm = GemmaRMSNorm(p.width, p.eps, **kw)
        self.expert_norm = make_norm(e.width, e.eps, config.pi05, **kw)
        add_heads(self, config, **kw)
        if seed is not None:
            init_parameters(self, seed, pi0_init_fn())

    def unused_names(self) -> list[str]:
        """Parameters that never reach the actions (module doc)."""
        last = f"layers.{self.config.depth - 1}.prefix."
        used = (last + "input_layernorm.", last + "self_attn.k_proj.", last + "self_attn.v_proj.")
        return [
            n
            for n, _ in self.named_parameters()
            if n.startswith("norm.") or (n.startswith(last) and not n.startswith(used))
        ]

    # -- the prefix --------------------------------------------------------------------------------
    def embed_prefix(self, images, image_masks, tokens, token_mask):
        """``(x (b, P, w_p), pad (b, P) bool)`` from ``images`` (b, n, 3, S, S) in [-1, 1],
        ``image_masks`` (b, n) bool (False: the camera is absent, its tokens masked out),
        ``tokens`` and ``token_mask`` (b, L)."""
        b, n = images.shape[:2]
        if n != self.config.num_cameras:
            raise ValueError(
                f"the model takes {self.config.num_cameras} cameras per sample, got {n} "
                f"(images of shape {tuple(images.shape)})"
            )
        dtype = self.projector.weight.dtype
        feats = self.vision(images.flatten(0, 1).to(dtype))  # (b n, p, w_v)
        p = feats.shape[1]
        img = self.projector(feats).reshape(b, n * p, -1)  # (b, n p, w_p)
        img_pad = image_masks.bool()[:, :, None].expand(b, n, p).reshape(b, n * p)  # (b, n p)
        text = self.embed_tokens(tokens) * math.sqrt(self.config.prefix.width)  # (b, L, w_p)
        x = torch.cat([img, text.to(img.dtype)], dim=1)  # (b, P, w_p)
        return x, torch.cat([img_pad, token_mask.bool()], dim=1)  # (b, P)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        p = self.config.prefix
        return rope_tables(positions, p.head_dim, p.rope_theta, dtype)  # each (b, 1, s, hd)

    # -- training: both streams at once ------------------------------------------------------------
    def forward(self, images, image_masks, tokens, token_mask, state, x_t, t) -> torch.Tensor:
        """The trainer's call (:func:`~.batches.stage_inputs`): :meth:`velocity` (pi0.5's
        ``state`` is ignored: it is in the prompt)."""
        state = None if self.config.pi05 else state
        return self.velocity(images, image_masks, tokens, token_mask, state, x_t, t)

    def velocity(self, images, image_masks, tokens, token_mask, state, x_t, t) -> torch.Tensor:
        """The model's velocity ``(b, H, A)`` float32 at noisy actions ``x_t`` (b, H, A) and
        times ``t`` (b,), over the prefix of :meth:`embed_prefix`; ``state`` (b, Ds) for pi0."""
        prefix, pad = self.embed_prefix(images, image_masks, tokens, token_mask)
        suffix, cond = embed_suffix(self, state, x_t, t)  # (b, S, w_e), (b, w_e) | None
        allowed, positions = joint_layout(pad, suffix_flags(self.config, pad.device))
        bias = attention_bias(allowed, prefix.dtype)  # (b, 1, T, T)
        cos, sin = self._rope(positions, prefix.dtype)
        xs = (prefix, suffix)
        last = self.config.depth - 1
        for i, layer in enumerate(self.layers.values()):
            xs = layer(xs, cos, sin, bias, cond, outputs=(i < last, True))
        return self.actions_out(xs[1], cond)

    def actions_out(self, suffix: torch.Tensor, cond) -> torch.Tensor:
        """The expert's final norm and ``action_out_proj`` over the last ``H`` tokens."""
        h, _ = self.expert_norm(suffix, cond)  # (b, S, w_e)
        h = h[:, -self.config.chunk :]  # (b, H, w_e)
        return self.action_out_proj(h.to(self.action_out_proj.weight.dtype)).float()  # (b, H, A)

    # -- inference: the prefix once, the expert per step -------------------------------------------
    def fill_cache(self, images, image_masks, tokens, token_mask) -> PrefixCache:
        """Run the prefix alone (it never sees the suffix) and keep its keys and values."""
        prefix, pad = self.embed_prefix(images, image_masks, tokens, token_mask)
        allowed, positions = joint_layout(pad, suffix_flags(self.config, pad.device))
        n = pad.shape[1]
        cache = PrefixCache(pad)
        cache.suffix_allowed, cache.suffix_positions = allowed[:, n:], positions[:, n:]
        bias = attention_bias(allowed[:, :n, :n], prefix.dtype)  # (b, 1, P, P)
        cos, sin = self._rope(positions[:, :n], prefix.dtype)
        xs = (prefix, None)
        last = self.config.depth - 1
        for i, layer in enumerate(self.layers.values()):
            xs = layer(xs, cos, sin, bias, cache=cache, outputs=(i < last, False))
        cache.filling = False
        return cache

    def cached_velocity(self, cache: PrefixCache, state, x_t, t) -> torch.Tensor:
        """:meth:`velocity` with the prefix's keys and values read from ``cache``."""
        suffix, cond = embed_suffix(self, state, x_t, t)  # (b, S, w_e)
        bias = attention_bias(cache.suffix_allowed, suffix.dtype)  # (b, 1, S, P + S)
        cos, sin = self._rope(cache.suffix_positions, suffix.dtype)
        xs = (None, suffix)
        for layer in self.layers.values():
            xs = layer(xs, cos, sin, bias, cond, cache=cache)
        return self.actions_out(xs[1], cond)
