"""OpenVLA: DINOv2 + SigLIP towers, a fused GELU projector and Llama-2, as pipeline-stage blocks.

Module paths equal the Hugging Face checkpoint names (``vision_backbone.featurizer.blocks.3...``,
``projector.fc1``, ``language_model.model.layers.17...``, ``language_model.lm_head``). The model
is the ordered block list ``["vision", "llm.0", ..., "llm.{L-1}", "head"]``: "vision" is both
towers, the projector, the token embedding and the multimodal merge; "head" the final norm and
lm_head. ``OpenVLA(config, ctx, blocks=range(a, b))`` builds only blocks ``a..b-1`` (a pipeline
stage), named as in the whole model. A stage's forward takes the previous stage's output
positionally: the first stage ``(pixel_values (b, 6, S, S), input_ids (b, t))``, every other
stage the hidden states ``(b, P + t, h)``; the last returns this rank's logits ``(b, P + t, V/tp)``
(or, with ``return_hidden`` set for training, the hidden states: the loss then applies
:meth:`head` to the few labelled positions only).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from parallax.families.openvla import objective as objectives
from parallax.families.openvla.action_tokenizer import ActionTokenizer
from parallax.families.openvla.checkpoint import OpenVLATensors, load_pretrained
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.oft.config import first_inputs as oft_first_inputs
from parallax.families.openvla.oft.head import (
    L1ActionHead,
    ProprioProjector,
    is_oft_name,
    oft_init_fn,
)
from parallax.families.openvla.oft.model import oft_embed
from parallax.families.openvla.oft.predict import predict_action_chunk
from parallax.families.openvla.predict import predict_action
from parallax.families.openvla.prompt import get_tokenizer
from parallax.init import InitFn
from parallax.models.stages import StageBlock
from parallax.models.vit import VisionTransformer
from parallax.models.vlm import VisionLanguageModel, unfused_init
from parallax.tensor import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.layers import weight_dtype

# unfused_init lives in models/vlm.py now; its old import path stays
__all__ = ["FusedMLPProjector", "OpenVLA", "VisionBackbone", "openvla_init_fn", "unfused_init"]


class VisionBackbone(nn.Module):
    """Channels 0-2 through DINOv2, 3-5 through SigLIP; features concatenated per patch.

    Several images (OpenVLA-OFT) come as ``(b, 6 n, S, S)``, six channels per image: each goes
    through both towers (as one batch of ``b n`` images) and the patch sequences are
    concatenated, image after image. ``film_dim``: every block of both towers has a FiLM slot,
    conditioned per sample (the same vector for each of its images)."""

    def __init__(self, config: OpenVLAConfig, ctx, device=None, dtype=None, film_dim=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype, film_dim=film_dim)
        self.featurizer = VisionTransformer(config.vision[0], ctx, **kw)
        self.fused_featurizer = VisionTransformer(config.vision[1], ctx, **kw)

    def forward(self, pixel_values: torch.Tensor, film: torch.Tensor | None = None):
        b, c, s = pixel_values.shape[0], pixel_values.shape[1], pixel_values.shape[-1]
        n = c // 6
        if n > 1:
            pixel_values = pixel_values.reshape(b * n, 6, s, s)  # image after image
            film = None if film is None else film.repeat_interleave(n, dim=0)  # (b n, h)
        args = () if film is None else (film,)
        img, img_fused = torch.split(pixel_values, [3, 3], dim=1)  # (b n, 3, S, S) each
        a = self.featurizer(img, *args)  # (b n, P, w1)
        f = self.fused_featurizer(img_fused, *args)  # (b n, P, w2)
        x = torch.cat([a, f], dim=2)  # (b n, P, w1 + w2)
        return x.reshape(b, n * x.shape[1], x.shape[2]) if n > 1 else x  # (b, n P, w1 + w2)


class FusedMLPProjector(nn.Module):
    """``fc3(gelu(fc2(gelu(fc1(x)))))``: fc1 column-, fc2 and fc3 row-parallel."""

    def __init__(self, vision_dim: int, llm_dim: int, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(ctx=ctx, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(vision_dim, 4 * vision_dim, True, **kw)
        self.fc2 = RowParallelLinear(4 * vision_dim, llm_dim, True, **kw)
        self.fc3 = RowParallelLinear(llm_dim, llm_dim, True, input_is_parallel=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))  # (b, P, 4d/tp)
        x = F.gelu(self.fc2(x))  # (b, P, h)
        return self.fc3(x)  # (b, P, h)


def openvla_init_fn(config: OpenVLAConfig, std: float = 0.02) -> InitFn:
    """OpenVLA's layout-free init: N(0, std) for matrices and embeddings, zeros for biases, ones
    for norm weights, LayerScale at its configured value; OFT's modules as ``nn.Linear`` and
    ``nn.LayerNorm`` initialise themselves (:func:`~.oft.head.oft_init_fn`)."""
    scales = {
        "vision_backbone.featurizer.": config.vision[0].layer_scale,
        "vision_backbone.fused_featurizer.": config.vision[1].layer_scale,
    }
    oft = config.oft
    if oft is not None:
        oft_init = oft_init_fn(config.text.hidden_size, oft.action_dim, oft.proprio_dim)

    def init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
        if oft is not None and is_oft_name(name):
            return oft_init(name, shape, gen, device)
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if name.endswith("scale_factor"):
            value = next(v for k, v in scales.items() if name.startswith(k))
            return torch.full(shape, float(value), device=device)
        if len(shape) == 1:
            return torch.ones(shape, device=device)
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return init


class OpenVLA(VisionLanguageModel):
    """The whole model, or the contiguous ``blocks`` of it that one pipeline stage holds (the
    constructor's arguments: :class:`~parallax.models.vlm.VisionLanguageModel`)."""

    tokenizer_of = staticmethod(get_tokenizer)
    init_fn_of = staticmethod(openvla_init_fn)
    # the Hugging Face OpenVLA layout, parallax's OFT export or OFT's own release
    # (from_pretrained(path, oft={"chunk": 8, "num_images": 2}): what OFT's files cannot tell)
    load_checkpoint = staticmethod(load_pretrained)

    @property
    def bidirectional(self) -> bool:
        return self.config.oft is not None

    @property
    def first_inputs(self) -> tuple[str, ...]:
        if self.config.oft is None:
            return ("pixel_values", "input_ids")
        return oft_first_inputs(self.config.oft)

    def build_vision(self, device, dtype) -> None:
        config, kw = self.config, dict(device=device, dtype=dtype)
        oft, h = config.oft, config.text.hidden_size
        film = h if oft is not None and oft.film else None
        self.vision_backbone = VisionBackbone(config, self.ctx, film_dim=film, **kw)
        self.projector = FusedMLPProjector(config.vision_dim, h, self.ctx, **kw)
        if oft is not None and oft.use_proprio:
            self.proprio_projector = ProprioProjector(oft.proprio_dim, h, **kw)

    def build_head(self, device, dtype) -> None:
        """OFT's L1 action head beside the final norm (the lm_head stays, unused)."""
        oft = self.config.oft
        if oft is not None:
            h = self.config.text.hidden_size
            self.action_head = L1ActionHead(
                h, oft.action_dim, self.ctx, oft.head_blocks, device=device, dtype=dtype
            )

    @functools.cached_property
    def action_tokenizer(self) -> ActionTokenizer:
        """Action bins <-> token ids (every stage: the last one's metrics read it)."""
        return ActionTokenizer.from_config(self.config)

    def vision_towers(self) -> list[nn.Module]:
        return [self.vision_backbone.featurizer, self.vision_backbone.fused_featurizer]

    # -- the block list ---------------------------------------------------------------------------
    @staticmethod
    def stage_blocks(config: OpenVLAConfig, text_tokens: int = 32) -> list[StageBlock]:
        """The ordered stage-able blocks with forward FLOPs per sample as their cost, for a
        sequence of ``P`` patches and ``text_tokens`` text tokens (with OFT: every image's
        patches, the proprio token, the prompt, the action slots and the stop token)."""
        oft = config.oft
        images = 1 if oft is None else oft.num_images
        text = text_tokens if oft is None else text_tokens + oft.slots + 1
        seq, p, d, h = (
            config.prefix_tokens + text,
            config.num_patches * images,
            config.vision_dim,
            config.text.hidden_size,
        )
        projector = 2 * p * (4 * d * d + 4 * d * h + h * h)
        vision = images * sum(v.flops() for v in config.vision) + projector
        llm = config.text.layer_flops(seq)
        if oft is None:
            head = config.text.head_flops(seq)
        else:  # the L1 head over the chunk's steps, no lm_head
            head = 2 * oft.chunk * (oft.action_dim * h * h + oft.head_blocks * h * h + h * h)
        return (
            [StageBlock("vision", vision)]
            + [StageBlock(f"llm.{i}", llm) for i in range(config.text.num_hidden_layers)]
            + [StageBlock("head", head)]
        )

    # -- forward pieces ---------------------------------------------------------------------------
    def embed(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, *oft_inputs):
        """Image patches inserted right after BOS: ``(b, 1 + P + t - 1, h)``; with OFT
        (``oft_inputs``: proprio, attention and action masks) the hidden states and the key
        mask of :func:`~.oft.model.oft_embed`."""
        if self.config.oft is not None:
            return oft_embed(self, pixel_values, input_ids, *oft_inputs)
        self.check_inputs(pixel_values, input_ids)
        dtype = weight_dtype(self.projector.fc1)
        patches = self.projector(self.vision_backbone(pixel_values.to(dtype)))  # (b, P, h)
        tokens = self.language_model.embed(input_ids)  # (b, t, h)
        return torch.cat([tokens[:, :1], patches, tokens[:, 1:]], dim=1)  # (b, P + t, h)

    def check_inputs(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> None:
        """``ValueError`` unless ``pixel_values`` is ``(b, 6 n, S, S)`` for this model's ``n``
        images and ``input_ids`` ``(b, t)``."""
        s = self.config.image_size
        c = 6 * (1 if self.config.oft is None else self.config.oft.num_images)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
            raise ValueError(
                f"pixel_values must be (b, {c}, {s}, {s}), got {tuple(pixel_values.shape)}"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != pixel_values.shape[0]:
            raise ValueError(
                f"input_ids must be (b, t) with b = {pixel_values.shape[0]}, "
                f"got {tuple(input_ids.shape)}"
            )

    def oft_actions(self, hidden: torch.Tensor) -> torch.Tensor:
        """OFT's head on the hidden states the last layer gives at the positions it reads,
        ``(b K D, h)`` in sample, then slot order: final norm, then the L1 head per chunk
        step -> normalised actions ``(b, K, D)``."""
        oft = self.config.oft
        x = self.language_model.model.norm(hidden)  # (b K D, h)
        x = x.reshape(-1, oft.action_dim * x.shape[-1])  # (b K, D h): one chunk step a row
        return self.action_head(x).reshape(-1, oft.chunk, oft.action_dim)  # (b, K, D)

    # -- training helpers -------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
        """Cross-entropy of this (last) stage's logits against text labels ``(b, t)``."""
        where = self._label_positions
        return objectives.vla_loss(logits, labels, self.ctx, reduction=reduction, **where)

    def action_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        where, tok = self._label_positions, self.action_tokenizer
        return objectives.action_metrics(logits, labels, self.ctx, action_tokenizer=tok, **where)

    @property
    def _label_positions(self) -> dict[str, int]:
        """Where the text labels sit in the logits: after the patches, within the vocabulary."""
        return dict(num_patches=self.config.num_patches, vocab_size=self.config.text.vocab_size)

    # -- checkpoints and inference ----------------------------------------------------------------
    def checkpoint_layout(self):
        """The Hugging Face checkpoint's tensor names for this model's parameters (fused
        projections stored split), as :mod:`parallax.models.hf_export` and LoRA read them."""
        return OpenVLATensors(self.config, type(self))

    def predict_action_chunk(self, images, instruction, proprio=None, **kwargs):
        """OpenVLA-OFT: the next ``K`` actions ``(K, D)`` of one sample, or ``(b, K, D)`` of a
        batch, from one forward pass (:func:`.oft.predict.predict_action_chunk`)."""
        return predict_action_chunk(self, images, instruction, proprio, **kwargs)

    def predict_action(self, image, instruction: str | None = None, unnorm_key=None, **kwargs):
        """One image -> continuous action (:func:`.predict.predict_action`)."""
        return predict_action(self, image, instruction, unnorm_key, **kwargs)
