"""LLaVA-NeXT (LLaVA-v1.6): CLIP ViT-L/14-336, an mlp2x_gelu projector, AnyRes and Vicuna (Llama-2).

Parameter names follow the llava-hf checkpoint (``multi_modal_projector.linear_1``,
``image_newline``, ``language_model.model.layers.17...``, ``language_model.lm_head``) except the
tower, which is parallax's :class:`~parallax.models.VisionTransformer` under ``vision_tower.`` (timm
names; :mod:`parallax.families.llava_next.checkpoint` maps them onto CLIP's). The tower stops at the
feature layer (the penultimate one), so its last layer and ``post_layernorm`` are never built; a
loaded checkpoint's copies are kept in ``hf_unused`` and written back on save.

The model is the block list ``["vision", "llm.0", ..., "llm.{L-1}", "head"]``. "vision" is the
tower, projector, ``image_newline``, the token embedding and the merge; "head" the final norm
and lm_head. ``LlavaNext(config, ctx, blocks=range(a, b))`` builds only those blocks, named as
in the whole model. The first stage takes ``(pixel_values, input_ids, image_sizes)`` in the
transformers convention: ``pixel_values (b, max_tiles, 3, S, S)`` with each sample's base image
first and zero tiles as padding, ``image_sizes (b, 2)`` as (height, width) with ``(0, 0)`` for a
sample without an image, and ``input_ids (b, t)`` holding one ``image_token_index`` per image
feature. Every later stage takes the hidden states ``(b, t, h)``; the last returns this rank's
logits ``(b, t, V/tp)`` (or, with ``return_hidden``, the hidden states for :meth:`head`).

Batches are right-padded. With causal attention every real token comes before the padding and
never attends to it, so no attention mask travels between stages; position ids are
``arange(t)`` as for an unpadded sequence, and the padding's outputs carry no label.
"""

from __future__ import annotations

import torch
from torch import nn

from parallax.families.llava_next import anyres
from parallax.families.llava_next import objective as llava_objectives
from parallax.families.llava_next.checkpoint import LLAVA_HF, CheckpointLayout, load_llava
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.flops import vision_forward_flops
from parallax.families.llava_next.predict import generate
from parallax.families.llava_next.template import llava_tokenizer
from parallax.families.llava_next.vision import (
    MultiModalProjector,
    check_inputs,
    image_sizes_list,
    llava_init_fn,
)
from parallax.models.stages import StageBlock
from parallax.models.vit import VisionTransformer
from parallax.models.vlm import VisionLanguageModel
from parallax.tensor.layers import weight_dtype


class LlavaNext(VisionLanguageModel):
    """The whole model, or the contiguous ``blocks`` of it that one pipeline stage holds (the
    constructor's arguments: :class:`~parallax.models.vlm.VisionLanguageModel`)."""

    first_inputs = ("pixel_values", "input_ids", "image_sizes")
    tokenizer_of = staticmethod(llava_tokenizer)
    init_fn_of = staticmethod(llava_init_fn)
    load_checkpoint = staticmethod(load_llava)  # llava-hf, transformers 5.x or original LLaVA-v1.6

    def build_vision(self, device, dtype) -> None:
        kw, h = dict(device=device, dtype=dtype), self.config.text.hidden_size
        self.vision_tower = VisionTransformer(self.config.vision, self.ctx, **kw)
        self.multi_modal_projector = MultiModalProjector(
            self.config.vision.width, h, self.ctx, **kw
        )
        self.image_newline = nn.Parameter(torch.zeros(h, **kw))  # replicated over tp

    def vision_towers(self) -> list[nn.Module]:
        return [self.vision_tower]

    # -- the block list ---------------------------------------------------------------------------
    @staticmethod
    def stage_blocks(config: LlavaNextConfig, text_tokens: int = 128) -> list[StageBlock]:
        """The ordered stage-able blocks with forward FLOPs per sample as their cost, for the
        worst case: an image of ``max_tiles`` tiles (5) and its most image tokens, plus
        ``text_tokens`` text tokens."""
        seq = config.max_image_tokens + text_tokens
        llm = config.text.layer_flops(seq)
        return (
            [StageBlock("vision", vision_forward_flops(config, config.max_tiles))]
            + [StageBlock(f"llm.{i}", llm) for i in range(config.text.num_hidden_layers)]
            + [StageBlock("head", config.text.head_flops(seq))]
        )

    # -- forward pieces ---------------------------------------------------------------------------
    def image_features(self, pixel_values: torch.Tensor, sizes: list) -> list[torch.Tensor]:
        """Each sample's image tokens ``(n_i, h)`` (``(0, h)`` without an image). The tower runs
        once on every real tile of the batch; a batch without any image runs it on one zero
        tile whose features are multiplied by 0, so the tower, projector and newline take part
        (zero gradients) and every rank makes the same collectives whatever the data."""
        cfg = self.config
        tiles = [
            0 if s is None else anyres.num_tiles(s, cfg.image_grid_pinpoints, cfg.tile_size)
            for s in sizes
        ]
        dtype = weight_dtype(self.multi_modal_projector.linear_1)
        real = [pixel_values[i, :n] for i, n in enumerate(tiles) if n]
        if real:
            x = torch.cat(real).to(dtype)  # (N, 3, S, S): every real tile of the batch
        else:
            x = pixel_values.new_zeros((1, *pixel_values.shape[2:]), dtype=dtype)
        feats = self.multi_modal_projector(self.vision_tower(x))  # (N, P, h)
        h = feats.shape[-1]
        if not real:
            zero = 0.0 * (feats.sum() + self.image_newline.sum())
            return [zero + feats.new_zeros((0, h)) for _ in sizes]
        out, start = [], 0
        for size, n in zip(sizes, tiles):
            if n == 0:
                out.append(feats.new_zeros((0, h)))
                continue
            grid = cfg.image_grid_pinpoints
            out.append(
                anyres.pack_image(
                    feats[start : start + n], size, grid, cfg.tile_size, self.image_newline
                )
            )
            start += n
        return out

    def embed(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, image_sizes
    ) -> torch.Tensor:
        """Token embeddings with the image features in place of the image tokens: ``(b, t, h)``."""
        sizes = image_sizes_list(image_sizes, input_ids.shape[0])
        check_inputs(self.config, pixel_values, input_ids, sizes)
        feats = self.image_features(pixel_values, sizes)
        tokens = self.language_model.embed(input_ids)  # (b, t, h)
        flat = torch.cat(feats).to(tokens.dtype)  # (image tokens of the batch, h), sample order
        mask = (input_ids == self.config.image_token_index).unsqueeze(-1)  # (b, t, 1)
        return tokens.masked_scatter(mask, flat)  # (b, t, h)

    # -- training helpers -------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
        """Next-token cross-entropy of this (last) stage's logits against labels ``(b, t)``."""
        return llava_objectives.llava_loss(
            logits, labels, self.ctx, vocab_size=self.config.vocab_size, reduction=reduction
        )

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return llava_objectives.answer_metrics(
            logits, labels, self.ctx, vocab_size=self.config.vocab_size
        )

    # -- checkpoints and inference ----------------------------------------------------------------
    def checkpoint_layout(self):
        """How parameters map onto the llava-hf checkpoint that ``save_pretrained`` writes."""
        return CheckpointLayout(self.config, LLAVA_HF, type(self))

    def generate(self, pixel_values, input_ids, image_sizes, max_new_tokens: int, **kwargs):
        """Greedy continuation (:func:`parallax.families.llava_next.predict.generate`)."""
        return generate(self, pixel_values, input_ids, image_sizes, max_new_tokens, **kwargs)
