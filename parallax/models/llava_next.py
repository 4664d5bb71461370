"""LLaVA-NeXT (LLaVA-v1.6): CLIP ViT-L/14-336, an mlp2x_gelu projector, AnyRes and Vicuna (Llama-2).

Parameter names follow the llava-hf checkpoint (``multi_modal_projector.linear_1``,
``image_newline``, ``language_model.model.layers.17...``, ``language_model.lm_head``) except the
tower, which is parallax's :class:`~parallax.models.VisionTransformer` under ``vision_tower.``
(timm names; :mod:`parallax.models.llava_hf` maps them onto CLIP's). The tower stops at the
feature layer (the penultimate one), so its last layer and ``post_layernorm`` are never built;
a loaded checkpoint's copies are kept in ``hf_unused`` and written back on save.

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

from pathlib import Path

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.init import InitFn, init_parameters
from parallax.models import anyres, llava_objectives
from parallax.models.llama import LlamaLM
from parallax.models.llava_config import LlavaNextConfig
from parallax.models.llava_vision import (
    MultiModalProjector,
    check_inputs,
    image_sizes_list,
    llava_init_fn,
)
from parallax.models.openvla import unfused_init
from parallax.models.stages import StageBlock, check_block_range, partition
from parallax.models.vit import VisionTransformer


class LlavaNext(nn.Module):
    """The whole model, or the contiguous ``blocks`` of it that one pipeline stage holds.

    ``ctx`` gives the tp group (``None``: one process). Without ``blocks``, a ``ctx`` with
    ``pp > 1`` takes this rank's range of a balanced :func:`~parallax.models.stages.partition`.
    Parameters are left as the layers initialise them unless ``seed`` is given; call
    :meth:`init_weights` (layout-free) or load a checkpoint.
    """

    def __init__(
        self,
        config: LlavaNextConfig,
        ctx: ParallelContext | None = None,
        *,
        blocks: range | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        activation_checkpointing: bool = False,
        freeze_vision: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.config, self.ctx = config, ctx
        n_layers = config.text.num_hidden_layers
        if blocks is None and ctx is not None and ctx.pp_size > 1:
            costs = [b.cost for b in self.stage_blocks(config)]
            blocks = partition(costs, ctx.pp_size)[ctx.pp_rank]
        self.block_range = check_block_range(blocks, n_layers + 2)
        self.has_vision = 0 in self.block_range
        self.has_head = n_layers + 1 in self.block_range
        first, stop = self.block_range.start, self.block_range.stop
        layers = range(max(first - 1, 0), min(stop - 1, n_layers))  # block i + 1 is layer i
        if device is None:
            device = ctx.device if ctx is not None else torch.device("cpu")
        kw = dict(device=device, dtype=dtype)
        h = config.text.hidden_size
        if self.has_vision:
            self.vision_tower = VisionTransformer(config.vision, ctx, **kw)
            self.multi_modal_projector = MultiModalProjector(config.vision.width, h, ctx, **kw)
            self.image_newline = nn.Parameter(torch.zeros(h, **kw))  # replicated over tp
        self.language_model = LlamaLM(
            config.text, ctx, layers=layers, embed=self.has_vision, head=self.has_head, **kw
        )
        self._tokenizer, self._tokenizer_loaded = None, False
        self.load_stats = None
        self.hf_unused: dict[str, torch.Tensor] = {}  # checkpoint-only tensors kept for saving
        self.return_hidden = False  # True: the last stage leaves norm + lm_head to the loss
        self.set_activation_checkpointing(activation_checkpointing)
        if freeze_vision:
            self.freeze_vision()
        if seed is not None:
            self.init_weights(seed)

    @property
    def tokenizer(self):
        """The text tokenizer (built in for ``llava-tiny``, the checkpoint's own otherwise; that
        needs the optional ``tokenizers`` or ``sentencepiece`` package)."""
        if not self._tokenizer_loaded:
            from parallax.models.llava_template import llava_tokenizer

            self._tokenizer, self._tokenizer_loaded = llava_tokenizer(self.config), True
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_loaded = value, True

    # -- the block list ---------------------------------------------------------------------------
    @staticmethod
    def stage_blocks(config: LlavaNextConfig, text_tokens: int = 128) -> list[StageBlock]:
        """The ordered stage-able blocks with forward FLOPs per sample as their cost, for the
        worst case: an image of ``max_tiles`` tiles (5) and its most image tokens, plus
        ``text_tokens`` text tokens."""
        from parallax.models.llava_flops import vision_forward_flops

        seq = config.max_image_tokens + text_tokens
        llm = config.text.layer_flops(seq)
        return (
            [StageBlock("vision", vision_forward_flops(config, config.max_tiles))]
            + [StageBlock(f"llm.{i}", llm) for i in range(config.text.num_hidden_layers)]
            + [StageBlock("head", config.text.head_flops(seq))]
        )

    @property
    def block_names(self) -> list[str]:
        names = [b.name for b in self.stage_blocks(self.config)]
        return [names[i] for i in self.block_range]

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
        dtype = self.multi_modal_projector.linear_1.weight.dtype
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

    def forward(self, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        if self.has_vision:
            args = list(inputs) + [
                named.pop(k)
                for k in ("pixel_values", "input_ids", "image_sizes")[len(inputs) :]
                if k in named
            ]
            if len(args) != 3 or named:
                raise ValueError("the first stage takes (pixel_values, input_ids, image_sizes)")
            x = self.embed(*args)
        else:
            if len(inputs) != 1 or named:
                raise ValueError("a later stage takes the hidden states (b, s, h) only")
            x = inputs[0]
        x = self.language_model.forward_layers(x)  # (b, t, h)
        return self.head(x) if self.has_head and not self.return_hidden else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states ``(..., h)`` -> this rank's logits
        ``(..., V/tp)``, for any leading shape (all positions, or gathered rows)."""
        return self.language_model.head(x)

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

    def init_weights(self, seed: int, init_fn: InitFn | None = None) -> None:
        """Layout-free init: the same seed gives the same logical weights at any tp and pp,
        with fused or separate projections."""
        init = unfused_init(init_fn or llava_init_fn(self.config), seed)
        init_parameters(self, seed, init_fn=init)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each ViT block and decoder layer in the backward (non-reentrant)."""
        self.language_model.activation_checkpointing = enabled
        if self.has_vision:
            self.vision_tower.activation_checkpointing = enabled

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each ViT block and decoder layer (their forward, in place)."""
        self.language_model.compile_layers(**options)
        if self.has_vision:
            self.vision_tower.compile_blocks(**options)

    def freeze_vision(self, frozen: bool = True) -> None:
        """Stop training the CLIP tower (the projector and newline stay trainable)."""
        if self.has_vision:
            for p in self.vision_tower.parameters():
                p.requires_grad_(not frozen)

    # -- checkpoints and inference ----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        ctx: ParallelContext | None = None,
        dtype: torch.dtype = torch.bfloat16,
        **kwargs,
    ) -> LlavaNext:
        """Load a llava-hf, transformers 5.x or original LLaVA-v1.6 checkpoint
        (:func:`parallax.models.llava_hf.load_llava`)."""
        from parallax.models.llava_hf import load_llava

        return load_llava(cls, path, ctx, dtype=dtype, **kwargs)

    def checkpoint_layout(self):
        """How parameters map onto the llava-hf checkpoint that ``save_pretrained`` writes."""
        from parallax.models.llava_hf import LLAVA_HF, CheckpointLayout

        return CheckpointLayout(self.config, LLAVA_HF)

    def save_pretrained(self, path: str | Path, **kwargs) -> None:
        """Write the llava-hf layout as published: see
        :func:`parallax.models.hf_save.save_pretrained`."""
        from parallax.models.hf_save import save_pretrained

        save_pretrained(self, path, **kwargs)

    def generate(self, pixel_values, input_ids, image_sizes, max_new_tokens: int, **kwargs):
        """Greedy continuation (:func:`parallax.models.llava_predict.generate`)."""
        from parallax.models.llava_predict import generate

        return generate(self, pixel_values, input_ids, image_sizes, max_new_tokens, **kwargs)
