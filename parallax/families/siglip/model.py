"""Siglip: a SigLIP (Git-RSCLIP) or CLIP image-text dual encoder on parallax layers.

``Siglip(config, ctx)`` holds both towers on every rank, sharded over tp, and is trained with
ZeRO-1 over dp; the contrastive loss (:mod:`parallax.tensor.contrastive`) then compares every
image with every text of the *global* batch through collectives over ``ctx.dp_group``. Pipeline
parallelism is refused: the towers are two parallel branches, not a chain, and the largest
preset (652M parameters) fits one GPU. Module paths are parallax's own
(``vision.trunk.blocks.3.attn.qkv``, ``text.head``...); :mod:`parallax.families.siglip.checkpoint`
maps them to the Hugging Face ``SiglipModel`` / ``CLIPModel`` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parallax.context import ParallelContext
from parallax.families.siglip.checkpoint import load_pretrained, save_pretrained
from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.inputs import text_tokenizer
from parallax.families.siglip.towers import TextTower, VisionTower
from parallax.init import InitFn, init_parameters
from parallax.models.compile import checkpoint_parts
from parallax.tensor.contrastive import contrastive_loss


@dataclass
class SiglipOutput:
    """L2-normalised embeddings ``(b, d)`` (full width on every tp rank) and the parameters
    that score them: ``logit_scale`` is log t; ``logit_bias`` is ``None`` for CLIP."""

    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    logit_scale: torch.Tensor
    logit_bias: torch.Tensor | None


def siglip_init_fn(config: SiglipConfig) -> InitFn:
    """Layout-free init: N(0, 1/fan_in) for matrices and the patch conv, N(0, 1/width) for
    token and position embeddings, the probe and the class token, zeros for biases, ones for
    norm weights, and the logit scale and bias at their starting values."""
    scale, bias = config.logit_scale_init, config.logit_bias_init

    def init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
        if name == "logit_scale":
            return torch.full(shape, float(scale), device=device)
        if name == "logit_bias":
            return torch.full(shape, float(bias), device=device)
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if len(shape) == 1:
            return torch.ones(shape, device=device)
        x = torch.empty(shape, device=device)
        if name.endswith(
            ("embedding.weight", "pos_embed", "position_embedding", "probe", "cls_token")
        ):
            return x.normal_(0.0, shape[-1] ** -0.5, generator=gen)
        return x.normal_(0.0, math.prod(shape[1:]) ** -0.5, generator=gen)

    return init


class Siglip(nn.Module):
    """Both towers plus ``logit_scale`` (log t, trained) and, for SigLIP, ``logit_bias``.

    ``ctx`` gives the tp group (``None``: one process) and the dp group the loss reduces over.
    Parameters are left as the layers initialise them unless ``seed`` is given; call
    :meth:`init_weights` (layout-free) or load a checkpoint.
    """

    def __init__(
        self,
        config: SiglipConfig,
        ctx: ParallelContext | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        activation_checkpointing: bool | str = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if ctx is not None and ctx.pp_size > 1:
            raise ValueError(
                f"dual encoders do not support pipeline parallelism (pp={ctx.pp_size}): the two "
                "towers are parallel branches, not a chain; use tp and dp (pp=1)"
            )
        self.config, self.ctx = config, ctx
        if device is None:
            device = ctx.device if ctx is not None else torch.device("cpu")
        kw = dict(device=device, dtype=dtype)
        self.vision = VisionTower(config, ctx, **kw)
        self.text = TextTower(config, ctx, **kw)
        self.logit_scale = nn.Parameter(torch.full((1,), config.logit_scale_init, **kw))
        bias = config.logit_bias_init
        self.logit_bias = None if bias is None else nn.Parameter(torch.full((1,), bias, **kw))
        self._tokenizer, self._tokenizer_loaded = None, False
        self.load_stats = None
        self.set_activation_checkpointing(activation_checkpointing)
        if seed is not None:
            self.init_weights(seed)

    # -- forward ---------------------------------------------------------------------------------
    def encode_image(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """``(b, 3, S, S)`` preprocessed images -> ``(b, d)`` embeddings."""
        s = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, s, s):
            raise ValueError(
                f"pixel_values must be (b, 3, {s}, {s}), got {tuple(pixel_values.shape)}; "
                "preprocess images with parallax.families.siglip.inputs.preprocess_images"
            )
        dtype = self.logit_scale.dtype
        x = self.vision(pixel_values.to(dtype))
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, input_ids: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """``(b, t)`` token ids, ``t <= max_length`` -> ``(b, d)`` embeddings."""
        limit = self.config.text.max_length
        if input_ids.dim() != 2 or input_ids.shape[1] > limit:
            raise ValueError(
                f"input_ids must be (b, t) with t <= {limit} (the text tower's position "
                f"embeddings), got {tuple(input_ids.shape)}; tokenize with truncation"
            )
        x = self.text(input_ids)
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> SiglipOutput:
        if pixel_values.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"{pixel_values.shape[0]} images but {input_ids.shape[0]} captions: "
                "a batch holds image-text pairs"
            )
        return SiglipOutput(
            self.encode_image(pixel_values),
            self.encode_text(input_ids),
            self.logit_scale,
            self.logit_bias,
        )

    def loss(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor, **kwargs):
        """This rank's contrastive loss over the global batch (see
        :func:`parallax.tensor.contrastive.contrastive_loss`): its dp mean is the global loss."""
        return contrastive_loss(
            self.config.loss,
            image_embeds,
            text_embeds,
            self.logit_scale,
            self.logit_bias,
            self.ctx,
            **kwargs,
        )

    # -- training helpers ------------------------------------------------------------------------
    def init_weights(self, seed: int, init_fn: InitFn | None = None) -> None:
        """Layout-free init: the same seed gives the same logical weights at any tp."""
        init_parameters(self, seed, init_fn=init_fn or siglip_init_fn(self.config))

    def set_activation_checkpointing(self, enabled: bool | str = True) -> None:
        """Recompute each block of both towers in the backward (non-reentrant); a scope
        (``"vision"``, ``"text"``: :func:`~parallax.models.compile.checkpoint_parts`) picks
        one tower."""
        vision, text = checkpoint_parts(enabled)
        self.vision.trunk.activation_checkpointing = vision
        self.text.activation_checkpointing = text

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each block of both towers (their forward, in place)."""
        self.vision.trunk.compile_blocks(**options)
        self.text.compile_blocks(**options)

    @property
    def tokenizer(self):
        """The text tokenizer: built in for the tiny presets, the checkpoint's own otherwise
        (needs the optional ``tokenizers`` extra); ``None`` when unavailable."""
        if not self._tokenizer_loaded:
            self._tokenizer, self._tokenizer_loaded = text_tokenizer(self.config), True
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_loaded = value, True

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        ctx: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32,
        **kwargs,
    ) -> Siglip:
        """Load a Hugging Face ``SiglipModel`` or ``CLIPModel`` checkpoint, each rank reading
        only its tp slice (:func:`parallax.families.siglip.checkpoint.load_pretrained`)."""
        return load_pretrained(cls, path, ctx, dtype=dtype, **kwargs)

    def save_pretrained(self, path: str | Path, **kwargs) -> None:
        """Write the Hugging Face layout (:func:`.checkpoint.save_pretrained`)."""
        save_pretrained(self, path, **kwargs)
