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
from torch.utils.checkpoint import checkpoint

from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.flops import forward_flops
from parallax.families.pi0.gemma import GemmaRMSNorm, make_norm, rope_tables
from parallax.families.pi0.joint import JointLayer, PrefixCache, attention_bias, joint_layout
from parallax.families.pi0.suffix import add_input_heads, embed_suffix, suffix_flags
from parallax.init import InitFn, init_parameters
from parallax.models.compile import checkpoint_parts, compile_modules
from parallax.models.stages import StageBlock, check_block_range
from parallax.models.vit import VisionTransformer
from parallax.tensor import VocabParallelEmbedding


def grid_sincos(tokens: int, width: int, device=None) -> torch.Tensor | None:
    """2-D sine-cosine position codes ``(1, tokens, width)`` of a square patch grid (row
    codes in the first half of the width, column codes in the second), or ``None`` where the
    grid is not square or the width not a multiple of 4."""
    side = math.isqrt(tokens)
    if side * side != tokens or width % 4:
        return None
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float64) / (width // 4))

    def code(p: torch.Tensor) -> torch.Tensor:
        angle = p.flatten().double()[:, None] * omega[None]  # (tokens, width/4)
        return torch.cat([angle.sin(), angle.cos()], dim=1)  # (tokens, width/2)

    return torch.cat([code(rows), code(cols)], dim=1).float()[None].to(device)


def pi0_init_fn() -> InitFn:
    """Layout-free init: N(0, 1/fan_in) for matrices, convolutions and embeddings (fan-in: the
    product of the trailing dims), zeros for biases; 1-D weights keep their module's constant
    (Gemma norms 0, as they scale by ``1 + w``; LayerNorms 1). The tower's position embedding
    starts as 2-D sine-cosine codes (MAE's fixed ones), so that a tower trained from scratch
    (the tiny presets) tells its patches apart by place from the first step (random codes of
    this init's scale are a tenth of the patches'; on the synthetic task the sampled chunks'
    held-out error after 6000 steps of 32 was 0.326 with these codes, 0.351 without)."""

    def init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor | None:
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if name.endswith("vision.pos_embed"):
            codes = grid_sincos(shape[1], shape[2], device)
            if codes is not None:
                return codes
        if len(shape) < 2:
            return None
        std = math.prod(shape[1:]) ** -0.5
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return init


class Pi0Model(nn.Module):
    """pi0 / pi0.5 on this rank (module doc): the whole model, or under a pipeline the chunk of
    ``blocks`` (:meth:`stage_blocks`: ``embed``, then ``layers.{i}``, the last with the output
    head); ``seed``: the layout-free init (else the layers' own)."""

    def __init__(
        self,
        config: Pi0Config,
        ctx=None,
        *,
        blocks: range | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx  # the export gathers over its tp group; under a pipeline, its stages
        kw = dict(device=device, dtype=dtype)
        p, e = config.prefix, config.expert
        self.block_range = check_block_range(blocks, config.depth + 1)
        self.has_embed = 0 in self.block_range
        self.has_head = config.depth in self.block_range
        if self.has_embed:
            self.vision = VisionTransformer(config.vision, ctx, **kw)
            self.projector = nn.Linear(config.vision.width, p.width, **kw)
            self.embed_tokens = VocabParallelEmbedding(p.vocab_size, p.width, ctx=ctx, **kw)
            add_input_heads(self, config, **kw)
        mine = [i - 1 for i in self.block_range if i > 0]
        self.layers = nn.ModuleDict({str(i): JointLayer(config, ctx, i, **kw) for i in mine})
        if self.has_head:
            self.norm = GemmaRMSNorm(p.width, p.eps, **kw)
            self.expert_norm = make_norm(e.width, e.eps, config.pi05, **kw)
            self.action_out_proj = nn.Linear(e.width, config.max_action_dim, **kw)
        self.checkpoint_layers = False  # recompute each joint layer in the backward
        if seed is not None:
            init_parameters(self, seed, pi0_init_fn())

    def set_activation_checkpointing(self, enabled: bool | str = True) -> None:
        """Recompute each ViT block and joint layer in the backward (non-reentrant); a scope
        (``"vision"``, ``"text"``: :func:`~parallax.models.compile.checkpoint_parts`) picks the
        tower or the joint layers alone."""
        vision, text = checkpoint_parts(enabled)
        self.checkpoint_layers = text
        if self.has_embed:
            self.vision.activation_checkpointing = vision

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each joint layer and ViT block (their forward, in place)."""
        compile_modules(self.layers.values(), **options)
        if self.has_embed:
            self.vision.compile_blocks(**options)

    @staticmethod
    def stage_blocks(config: Pi0Config) -> list[StageBlock]:
        """``embed`` (tower, projector, embeddings, the suffix's input heads), then layer ``i``
        of both streams per block, the last with the norms and ``action_out_proj``."""
        f = forward_flops(config)
        layer = (f["prefix"] + f["expert"]) / config.depth
        blocks = [StageBlock("embed", f["vision"] + f["heads"] / 2)]
        blocks += [StageBlock(f"layers.{i}", layer) for i in range(config.depth)]
        return blocks

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
    def forward(self, *inputs: torch.Tensor):
        """The trainer's call. The first block takes :func:`~.batches.stage_inputs` (the
        prefix's inputs, ``state``, ``x_t``, ``t``; pi0.5 ignores ``state``: it is in the
        prompt); a later one ``(prefix, suffix, pad[, cond])``, what every block but the last
        hands on; the last returns the velocity ``(b, H, A)`` float32."""
        if self.has_embed:
            images, image_masks, tokens, token_mask, state, x_t, t = inputs
            state = None if self.config.pi05 else state
            prefix, pad = self.embed_prefix(images, image_masks, tokens, token_mask)
            suffix, cond = embed_suffix(self, state, x_t, t)  # (b, S, w_e), (b, w_e) | None
        else:
            prefix, suffix, pad, *rest = inputs
            cond = rest[0] if rest else None
        xs = self.run_layers(prefix, suffix, pad.bool(), cond)
        if self.has_head:
            return self.actions_out(xs[1], cond)
        return (*xs, pad, *(() if cond is None else (cond,)))

    def velocity(self, images, image_masks, tokens, token_mask, state, x_t, t) -> torch.Tensor:
        """The whole model's velocity ``(b, H, A)`` float32 at noisy actions ``x_t``
        (b, H, A) and times ``t`` (b,), over the prefix of :meth:`embed_prefix`; ``state``
        (b, Ds) for pi0."""
        if not (self.has_embed and self.has_head):
            raise ValueError("velocity runs the whole model: under a pipeline, train")
        return self(images, image_masks, tokens, token_mask, state, x_t, t)

    def run_layers(self, prefix, suffix, pad, cond):
        """This chunk's joint layers over ``prefix`` (b, P, w_p) and ``suffix`` (b, S, w_e)."""
        allowed, positions = joint_layout(pad, suffix_flags(self.config, pad.device))
        bias = attention_bias(allowed, prefix.dtype)  # (b, 1, T, T)
        cos, sin = self._rope(positions, prefix.dtype)
        xs = (prefix, suffix)
        last = self.config.depth - 1
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for i, layer in self.layers.items():
            args = (xs, cos, sin, bias, cond, None, (int(i) < last, True))
            xs = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return xs

    def actions_out(self, suffix: torch.Tensor, cond) -> torch.Tensor:
        """The expert's final norm and ``action_out_proj`` over the last ``H`` tokens."""
        h, _ = self.expert_norm(suffix, cond)  # (b, S, w_e)
        h = h[:, -self.config.chunk :]  # (b, H, w_e)
        return self.action_out_proj(h.to(self.action_out_proj.weight.dtype)).float()  # (b, H, A)

    # -- inference: the prefix once, the expert per step -------------------------------------------
    def fill_cache(self, images, image_masks, tokens, token_mask) -> PrefixCache:
        """Run the prefix alone (it never sees the suffix) and keep its keys and values."""
        return self.cache_prefix(*self.embed_prefix(images, image_masks, tokens, token_mask))[0]

    def cache_prefix(self, prefix: torch.Tensor, pad: torch.Tensor):
        """This chunk's layers over the prefix's hidden states ``prefix`` (b, P, w_p) with its
        padding mask ``pad`` (b, P): ``(cache of their keys and values, the hidden states the
        next chunk's layers take (b, P, w_p), None after the last layer)``."""
        allowed, positions = joint_layout(pad, suffix_flags(self.config, pad.device))
        n = pad.shape[1]
        cache = PrefixCache(pad)
        cache.suffix_allowed, cache.suffix_positions = allowed[:, n:], positions[:, n:]
        bias = attention_bias(allowed[:, :n, :n], prefix.dtype)  # (b, 1, P, P)
        cos, sin = self._rope(positions[:, :n], prefix.dtype)
        xs = (prefix, None)
        last = self.config.depth - 1
        for i, layer in self.layers.items():
            xs = layer(xs, cos, sin, bias, cache=cache, outputs=(int(i) < last, False))
        cache.filling = False
        return cache, xs[0]

    def cached_velocity(self, cache: PrefixCache, state, x_t, t) -> torch.Tensor:
        """:meth:`velocity` with the prefix's keys and values read from ``cache``."""
        suffix, cond = embed_suffix(self, state, x_t, t)  # (b, S, w_e)
        return self.actions_out(self.cached_layers(cache, suffix, cond), cond)

    def cached_layers(self, cache: PrefixCache, suffix: torch.Tensor, cond) -> torch.Tensor:
        """This chunk's layers over the expert's tokens ``suffix`` (b, S, w_e), attending to the
        cached prefix; ``cond`` (b, w_e): pi0.5's time conditioning."""
        bias = attention_bias(cache.suffix_allowed, suffix.dtype)  # (b, 1, S, P + S)
        cos, sin = self._rope(cache.suffix_positions, suffix.dtype)
        xs = (None, suffix)
        for layer in self.layers.values():
            xs = layer(xs, cos, sin, bias, cond, cache=cache)
        return xs[1]  # (b, S, w_e)
