"""Model FLOPs of OpenVLA training, per sample and per step.

Formula (per sample; a training step is forward + backward = 3 x the forward):

    FLOPs = sum over components c of  6 x N_c x T_c          (2 x N_c x T_c for a frozen tower)
          + 3 x attention scores and context per layer     (1 x for a frozen tower)

``N_c`` counts every parameter of the blocks that actually run (weights, biases, norms,
LayerScale), excluding lookups (token embedding, position embeddings, class and register
tokens); ``T_c`` is the number of tokens the component sees:

- DINOv2 tower: patch embedding over the ``P`` = 256 patches, then blocks 0..22 (the towers stop
  at the penultimate block) over 261 tokens (256 patches + cls + 4 registers);
- SigLIP tower: patch embedding and blocks 0..25 over 256 tokens;
- projector over the 256 patches;
- Llama decoder layers and the final norm over the whole sequence ``S = P + t`` (``t`` text
  tokens including BOS);
- lm_head over the positions where logits are computed: all ``S`` (what the model runs, the
  default) or only the labelled ones (what the Trainer runs with ``--logits labelled``; the
  final norm is counted over all ``S`` either way, a negligible ``h`` per token).

Attention scores ``QK^T`` and context ``AV`` cost ``2 x n^2 x d`` each in the forward (``d`` =
heads x head dim) for a bidirectional ViT block over ``n`` tokens. For the causal Llama layers
the mask halves them, ``2 x S^2 x d`` in all, which is the convention of Megatron-LM's
``num_floating_point_operations`` today (its older releases counted the full square).

MFU is :func:`parallax.train.flops.mfu` of these FLOPs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.objective import loss_token_count
from parallax.models.flops import Component, llama_layer_params, vit_components


def openvla_components(
    config: OpenVLAConfig,
    text_tokens: int,
    *,
    logit_positions: int | None = None,
    frozen_vision: bool = False,
) -> dict[str, Component]:
    """Every component of one training sample with ``text_tokens`` input ids (BOS included).

    ``logit_positions``: where the lm_head runs (default: every position of the sequence).
    """
    if text_tokens < 1:
        raise ValueError(f"text_tokens must be >= 1 (BOS at least), got {text_tokens}")
    p, t = config.num_patches, config.text
    seq = p + text_tokens
    positions = seq if logit_positions is None else logit_positions
    if not 0 <= positions <= seq:
        raise ValueError(f"logit_positions must be in [0, {seq}], got {logit_positions}")
    d, h = config.vision_dim, t.hidden_size
    parts: dict[str, Component] = {}
    parts.update(vit_components(config.vision[0], "dinov2", not frozen_vision))
    parts.update(vit_components(config.vision[1], "siglip", not frozen_vision))
    projector = (d * 4 * d + 4 * d) + (4 * d * h + h) + (h * h + h)
    parts["projector"] = Component(projector, p, 0.0)
    layers = t.num_hidden_layers
    attention = layers * 2.0 * seq * seq * t.num_attention_heads * t.head_dim  # causal: halved
    parts["llama"] = Component(layers * llama_layer_params(t) + h, seq, attention)
    parts["lm_head"] = Component(h * t.vocab_size, positions, 0.0)
    return parts


def openvla_flops_per_sample(
    config: OpenVLAConfig,
    text_tokens: int,
    *,
    logit_positions: int | None = None,
    frozen_vision: bool = False,
) -> float:
    """Training FLOPs of one sample (see the module docstring for the formula)."""
    parts = openvla_components(
        config, text_tokens, logit_positions=logit_positions, frozen_vision=frozen_vision
    )
    return sum(c.flops for c in parts.values())


def batch_flops(
    config: OpenVLAConfig,
    microbatches: Sequence[Mapping[str, torch.Tensor]],
    *,
    labelled_logits: bool = False,
    frozen_vision: bool = False,
) -> float:
    """Training FLOPs of these microbatches (``input_ids`` and ``labels`` ``(b, t)``), with the
    lm_head over every position or, with ``labelled_logits``, over the labelled ones only (the
    count is read from the labels: keep them on the host to avoid a device sync)."""

    head, total = config.text.hidden_size * config.text.vocab_size, 0.0
    for mb in microbatches:
        b, t = mb["input_ids"].shape
        per_sample = openvla_flops_per_sample(
            config, t, logit_positions=0, frozen_vision=frozen_vision
        )
        if labelled_logits:
            positions = int(loss_token_count(mb["labels"]))
        else:
            positions = b * (config.num_patches + t)
        total += b * per_sample + Component(head, positions, 0.0).flops
    return total
