"""A Vision Transformer (timm layout) written with parallax tensor layers.

One class covers DINOv2 with registers and LayerScale, SigLIP and CLIP-style towers: the
options below are the only differences between them. Parameter names follow timm
(``patch_embed.proj``, ``blocks.{i}.attn.qkv``, ``blocks.{i}.ls1.scale_factor``...), so a timm or
Prismatic state dict maps onto it by name. Blocks are kept in a ``ModuleDict`` keyed by their
global index. Only the blocks up to the feature layer are built: a VLM that reads the
penultimate block never pays for (or trains) the last one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallax.context import ParallelContext
from parallax.models.compile import CheckpointedBlocks, compile_modules, traced_recompute
from parallax.models.vit_config import ACTIVATIONS, ViTConfig
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, heads_per_rank, resolve_tp

__all__ = [
    "ACTIVATIONS",
    "PatchEmbed",
    "LayerScale",
    "ViTAttention",
    "ViTBlock",
    "ViTConfig",
    "ViTMLP",
    "VisionTransformer",
    "activation",
    "checkpoint_only_tensors",
]


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return x * torch.sigmoid(1.702 * x)  # quick_gelu (CLIP)


class LayerScale(nn.Module):
    """``x * scale_factor`` (named as in the Hugging Face OpenVLA checkpoint, timm's ``gamma``)."""

    def __init__(self, dim: int, init_value: float, device=None, dtype=None) -> None:
        super().__init__()
        self.init_value = init_value
        self.scale_factor = nn.Parameter(torch.full((dim,), init_value, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


class ViTAttention(nn.Module):
    """Bidirectional multi-head attention; the fused qkv weight is split per head across tp."""

    def __init__(self, cfg: ViTConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        self.heads = heads_per_rank(cfg.num_heads, resolve_tp(ctx)[2], "ViT attention")
        self.causal = cfg.causal
        self.head_dim = cfg.width // cfg.num_heads
        kw = dict(ctx=ctx, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(cfg.width, 3 * cfg.width, cfg.qkv_bias, partitions=3, **kw)
        self.proj = RowParallelLinear(cfg.width, cfg.width, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, -1, self.head_dim)  # (b, n, 3, nh/tp, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, nh/tp, n, hd)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (b, nh/tp, n, hd)
        return self.proj(o.transpose(1, 2).reshape(b, n, -1))  # (b, n, w)


class ViTMLP(nn.Module):
    def __init__(self, cfg: ViTConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(ctx=ctx, device=device, dtype=dtype)
        self.act = cfg.act
        self.fc1 = ColumnParallelLinear(cfg.width, cfg.mlp_hidden, True, **kw)
        self.fc2 = RowParallelLinear(cfg.mlp_hidden, cfg.width, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))  # (b, n, w); fc1 out is (b, n, f/tp)


class ViTBlock(nn.Module):
    """Pre-norm block: ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``.

    With ``film_dim`` the block has a FiLM slot (OpenVLA-OFT+'s language conditioning):
    ``gamma, beta = film_scale(c), film_shift(c)`` of a conditioning vector ``c`` (b, film_dim)
    modulate the stream between attention and MLP, ``x * (1 + gamma) + beta``. The two linears
    are column-parallel with their outputs gathered (each rank holds ``width / tp`` rows).
    """

    checkpointed = False  # recompute in the backward (activation checkpointing)

    def __init__(
        self, cfg: ViTConfig, ctx, device=None, dtype=None, film_dim: int | None = None
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps, **kw)
        self.attn = ViTAttention(cfg, ctx, **kw)
        self.ls1 = (
            LayerScale(cfg.width, cfg.layer_scale, **kw) if cfg.layer_scale else nn.Identity()
        )
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps, **kw)
        self.mlp = ViTMLP(cfg, ctx, **kw)
        self.ls2 = (
            LayerScale(cfg.width, cfg.layer_scale, **kw) if cfg.layer_scale else nn.Identity()
        )
        if film_dim:
            film = dict(bias=True, gather_output=True, ctx=ctx, **kw)
            self.film_scale = ColumnParallelLinear(film_dim, cfg.width, **film)
            self.film_shift = ColumnParallelLinear(film_dim, cfg.width, **film)

    def forward(self, x: torch.Tensor, film: torch.Tensor | None = None) -> torch.Tensor:
        """``film`` (b, film_dim): the FiLM conditioning (blocks built with ``film_dim``)."""
        args = (x,) if film is None else (x, film)
        if self.checkpointed and torch.is_grad_enabled():
            # inside forward: a compiled block keeps the recomputation in its own graphs
            return checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)

    def _forward(self, x: torch.Tensor, film: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        if film is not None:
            gamma = self.film_scale(film)[:, None]  # (b, 1, w)
            beta = self.film_shift(film)[:, None]  # (b, 1, w)
            x = x * (1 + gamma) + beta
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig, device=None, dtype=None) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(
            3, cfg.width, p, stride=p, bias=cfg.patch_bias, device=device, dtype=dtype
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # (b, patches, w), row-major


class VisionTransformer(CheckpointedBlocks, nn.Module):
    """Image -> features of block ``cfg.feature_layer`` (patch tokens unless ``keep_prefix``);
    ``film_dim``: every block has a FiLM slot (:class:`ViTBlock`)."""

    def __init__(
        self,
        cfg: ViTConfig,
        ctx: ParallelContext | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        film_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.film_dim = film_dim
        kw = dict(device=device, dtype=dtype)
        w = cfg.width
        self.patch_embed = PatchEmbed(cfg, **kw)
        if cfg.class_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, w, **kw))
        if cfg.reg_tokens:
            self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, w, **kw))
        pos_len = cfg.num_patches + (0 if cfg.no_embed_class else cfg.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_len, w, **kw))
        if cfg.pre_norm:
            self.norm_pre = nn.LayerNorm(w, eps=cfg.ln_eps, **kw)
        self.blocks = nn.ModuleDict(
            {
                str(i): ViTBlock(cfg, ctx, film_dim=film_dim, **kw)
                for i in range(cfg.feature_index + 1)
            }
        )
        if cfg.final_norm:
            self.norm = nn.LayerNorm(w, eps=cfg.ln_eps, **kw)
        self._traced_recompute = traced_recompute(ctx)
        self.activation_checkpointing = False

    def _blocks(self):
        return self.blocks.values()

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each block's forward in place
        (:func:`parallax.models.compile.compile_modules`)."""
        compile_modules(self.blocks.values(), **options)

    def _prefix(self, b: int) -> list[torch.Tensor]:
        out = []
        if self.cfg.class_token:
            out.append(self.cls_token.expand(b, -1, -1))
        if self.cfg.reg_tokens:
            out.append(self.reg_token.expand(b, -1, -1))
        return out

    def forward(self, images: torch.Tensor, film: torch.Tensor | None = None) -> torch.Tensor:
        """``film`` (b, film_dim): FiLM conditioning for every block (a tower built with
        ``film_dim``), one vector per image."""
        cfg = self.cfg
        if (film is None) != (not self.film_dim):
            raise ValueError(
                f"a tower built with film_dim={self.film_dim} takes "
                f"{'a' if self.film_dim else 'no'} FiLM conditioning"
            )
        args = () if film is None else (film,)
        x = self.patch_embed(images)  # (b, patches, w)
        prefix = self._prefix(x.shape[0])
        if cfg.no_embed_class:  # DINOv2 in timm: position embedding on patches, then prefix
            x = torch.cat([*prefix, x + self.pos_embed], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + self.pos_embed
        if cfg.pre_norm:
            x = self.norm_pre(x)
        outside = self._checkpoint_outside and torch.is_grad_enabled()
        for block in self.blocks.values():  # (b, prefix + patches, w)
            x = checkpoint(block, x, *args, use_reentrant=False) if outside else block(x, *args)
        if cfg.final_norm:
            x = self.norm(x)
        return x if cfg.keep_prefix else x[:, cfg.num_prefix_tokens :]


def _linear(name: str, d_out: int, d_in: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (d_out, d_in), f"{name}.bias": (d_out,)}


def _norm(name: str, w: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (w,), f"{name}.bias": (w,)}


def checkpoint_only_tensors(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a full timm checkpoint of this tower holds but the
    feature extractor never uses: blocks after the feature layer, the final norm when it is
    not applied, and the pooling head."""
    w, f = cfg.width, cfg.mlp_hidden
    block = {
        **_norm("norm1", w),
        "attn.qkv.weight": (3 * w, w),
        **_linear("attn.proj", w, w),
        **_norm("norm2", w),
        **_linear("mlp.fc1", f, w),
        **_linear("mlp.fc2", w, f),
    }
    if cfg.qkv_bias:
        block["attn.qkv.bias"] = (3 * w,)
    if cfg.layer_scale:
        block["ls1.scale_factor"] = block["ls2.scale_factor"] = (w,)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.feature_index + 1, cfg.depth):
        out.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    if not cfg.final_norm:
        out.update(_norm("norm", w))
    if cfg.pool == "map":
        out["attn_pool.latent"] = (1, 1, w)
        for name, d_out, d_in in (("q", w, w), ("kv", 2 * w, w), ("proj", w, w)):
            out.update(_linear(f"attn_pool.{name}", d_out, d_in))
        out.update(_norm("attn_pool.norm", w))
        out.update({**_linear("attn_pool.mlp.fc1", f, w), **_linear("attn_pool.mlp.fc2", w, f)})
    return out
