"""What OpenVLA and LLaVA-NeXT share: vision towers and a projector feeding a Llama, cut into the
block list ``["vision", "llm.0", ..., "llm.{L-1}", "head"]`` that pipeline stages take ranges of.

A family says only what differs (:class:`VisionLanguageModel`'s hooks): how its vision block is
built and embeds the first stage's inputs, its stage costs, its init and its tokenizer. The block
range, the Llama piece, the forward through the layers, the head, activation checkpointing,
compilation, freezing the towers and saving are written once here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.init import InitFn, init_parameters, param_seed
from parallax.models.compile import checkpoint_parts
from parallax.models.hf_export import save_pretrained
from parallax.models.hf_io import hf_names
from parallax.models.llama import LlamaLM
from parallax.models.stages import StageBlock, check_block_range, partition

log = logging.getLogger(__name__)


def unfused_init(init: InitFn, seed: int) -> InitFn:
    """``init`` for fused projections (``qkv_proj``, ``gate_up_proj``) drawn as the separate
    Hugging Face tensors they stand for, each from its own name's seed, then stacked: fused and
    separate projections start from the same logical weights."""

    def fused_aware(name: str, shape: tuple[int, ...], gen: torch.Generator, device):
        parts = hf_names(name, shape)
        if len(parts) == 1:
            return init(name, shape, gen, device)
        blocks = []
        for part, part_shape in parts:
            g = torch.Generator(device=device).manual_seed(param_seed(seed, part))
            blocks.append(init(part, part_shape, g, device))
        return torch.cat(blocks)  # (k * rows, ...): the blocks in partition order

    return fused_aware


class VisionLanguageModel(nn.Module):
    """The whole model, or the contiguous ``blocks`` of it that one pipeline stage holds.

    ``ctx`` gives the tp group (``None``: one process). Without ``blocks``, a ``ctx`` with
    ``pp > 1`` takes this rank's range of a balanced :func:`~parallax.models.stages.partition`.
    Parameters are left as the layers initialise them unless ``seed`` is given; call
    :meth:`init_weights` (layout-free) or load a checkpoint.
    """

    first_inputs: tuple[str, ...]  # what the first stage's forward takes, in order
    # attention over a padded sequence in both directions (the key mask travels with the
    # hidden states between stages): OpenVLA-OFT's parallel decoding
    bidirectional: bool = False

    def __init__(
        self,
        config,
        ctx: ParallelContext | None = None,
        *,
        blocks: range | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        activation_checkpointing: bool | str = False,
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
        if self.has_vision:
            self.build_vision(**kw)
        self.language_model = LlamaLM(
            config.text, ctx, layers=layers, embed=self.has_vision, head=self.has_head, **kw
        )
        if self.has_head:
            self.build_head(**kw)
        self._tokenizer, self._tokenizer_loaded = None, False
        self.load_stats = None
        self.hf_unused: dict[str, torch.Tensor] = {}  # checkpoint-only tensors kept for saving
        self.return_hidden = False  # True: the last stage leaves norm + lm_head to the loss
        self.set_activation_checkpointing(activation_checkpointing)
        if freeze_vision:
            self.freeze_vision()
        if seed is not None:
            self.init_weights(seed)

    # -- what a family says ---------------------------------------------------------------------
    def build_vision(self, device, dtype) -> None:
        """Make the vision block's modules (towers, projector, ...) on ``self``."""
        raise NotImplementedError

    def build_head(self, device, dtype) -> None:
        """Make the last stage's own modules besides the final norm and lm_head (none by
        default; OpenVLA-OFT's action head)."""

    def vision_towers(self) -> list[nn.Module]:
        """The :class:`~parallax.models.VisionTransformer` towers of the vision block."""
        raise NotImplementedError

    def embed(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The first stage's inputs -> the hidden states ``(b, s, h)`` the layers take."""
        raise NotImplementedError

    @staticmethod
    def stage_blocks(config) -> list[StageBlock]:
        raise NotImplementedError

    # the family's functions (staticmethods): its tokenizer and layout-free init of a config,
    # and its checkpoint reader ``(cls, path, ctx, dtype=..., **kwargs) -> model``
    tokenizer_of: Callable[[Any], Any]
    init_fn_of: Callable[[Any], InitFn]
    load_checkpoint: Callable[..., Any]

    def default_init_fn(self) -> InitFn:
        return self.init_fn_of(self.config)

    def load_tokenizer(self):
        return self.tokenizer_of(self.config)

    # -- written once ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The text tokenizer (the family's built-in one for its tiny preset, the checkpoint's
        own when the optional package is installed; ``None`` when unavailable)."""
        if not self._tokenizer_loaded:
            self._tokenizer, self._tokenizer_loaded = self.load_tokenizer(), True
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_loaded = value, True

    @property
    def block_names(self) -> list[str]:
        names = [b.name for b in self.stage_blocks(self.config)]
        return [names[i] for i in self.block_range]

    def forward(self, *inputs: torch.Tensor, **named: torch.Tensor):
        """The first stage takes ``first_inputs``, a later stage the previous one's output.

        When :meth:`embed` returns ``(x, key_mask)`` (a model with bidirectional attention over
        a padded sequence: OpenVLA-OFT), the layers attend over the keys the mask keeps and
        every stage but the last passes ``(x, key_mask)`` on; otherwise attention is causal
        and a stage passes ``x`` alone."""
        if self.has_vision:
            rest = self.first_inputs[len(inputs) :]
            args = list(inputs) + [named.pop(k) for k in rest if k in named]
            if len(args) != len(self.first_inputs) or named:
                raise ValueError(f"the first stage takes ({', '.join(self.first_inputs)})")
            out = self.embed(*args)
        else:
            want = 2 if self.bidirectional else 1
            if len(inputs) != want or named:
                mask = " and the key mask (b, s)" if self.bidirectional else " only"
                raise ValueError(f"a later stage takes the hidden states (b, s, h){mask}")
            out = inputs if want == 2 else inputs[0]
        x, key_mask = out if isinstance(out, tuple | list) else (out, None)
        x = self.language_model.forward_layers(x, key_mask=key_mask)  # (b, s, h)
        if self.has_head:
            return x if self.return_hidden else self.head(x)
        return x if key_mask is None else (x, key_mask)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states ``(..., h)`` -> this rank's logits
        ``(..., V/tp)``, for any leading shape (all positions, or gathered rows)."""
        return self.language_model.head(x)

    def init_weights(self, seed: int, init_fn: InitFn | None = None) -> None:
        """Layout-free init: the same seed gives the same logical weights at any tp and pp,
        with fused or separate projections."""
        init = unfused_init(init_fn or self.default_init_fn(), seed)
        init_parameters(self, seed, init_fn=init)

    def set_activation_checkpointing(self, enabled: bool | str = True) -> None:
        """Recompute each ViT block and decoder layer in the backward (non-reentrant); a scope
        (``"vision"``, ``"text"``: :func:`~parallax.models.compile.checkpoint_parts`) picks
        the towers or the language model alone."""
        vision, text = checkpoint_parts(enabled)
        self.language_model.activation_checkpointing = text
        for tower in self.vision_towers() if self.has_vision else ():
            tower.activation_checkpointing = vision

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each ViT block and decoder layer (their forward, in place), not the
        whole model: the graphs stay small, repeat across layers and keep activation
        checkpointing and pipeline cuts outside. ``options`` go to ``torch.compile``."""
        self.language_model.compile_layers(**options)
        for tower in self.vision_towers() if self.has_vision else ():
            tower.compile_blocks(**options)

    def freeze_vision(self, frozen: bool = True) -> None:
        """Stop training the vision towers (the projector stays trainable)."""
        for tower in self.vision_towers() if self.has_vision else ():
            for p in tower.parameters():
                p.requires_grad_(not frozen)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        ctx: ParallelContext | None = None,
        dtype: torch.dtype = torch.bfloat16,
        **kwargs,
    ) -> VisionLanguageModel:
        """Load a checkpoint of the family, each rank reading only its slice (the family's
        ``load_checkpoint``; ``kwargs`` go to it)."""
        return cls.load_checkpoint(cls, path, ctx, dtype=dtype, **kwargs)

    def save_pretrained(self, path: str | Path, **kwargs) -> None:
        """Write the family's Hugging Face layout as published: see
        :func:`parallax.models.hf_export.save_pretrained`."""
        save_pretrained(self, path, **kwargs)


def with_fusion(config: Any, fused: bool) -> Any:
    """A VLM's ``config`` (OpenVLA's, LLaVA-NeXT's) with fused q/k/v and gate/up projections
    as asked, where the model allows them (grouped-query attention keeps them separate)."""
    text = config.text
    if fused and text.kv_heads != text.num_attention_heads:
        log.info(
            "fused projections need as many key/value heads as query heads (%d != %d): "
            "keeping separate projections",
            text.kv_heads,
            text.num_attention_heads,
        )
        fused = False
    return config.with_options(fused_projections=fused)
