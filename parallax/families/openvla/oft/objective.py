"""OpenVLA-OFT's loss, metrics and model FLOPs (``--action-head l1``).

The loss is OFT's: the mean absolute error between the predicted and the true normalised
action chunks ``(B, K, D)``, over the whole global batch (the trainer divides this sum by the
batch's ``B x K x D``). The head reads the last stage's hidden states at the rows
:func:`~.config.head_rows` lists (found on the host from the prompt lengths), the same on
every tp rank. Metrics are OFT's logged ones: the L1 error of the chunk's first action
(``curr_action_l1_loss``) and of the rest (``next_actions_l1_loss``). :func:`oft_loss` computes
both of a batch without the Trainer.

FLOPs per sample (2 per multiply-add; a weight's forward ``2 N T``, its input gradient
``2 N T`` when something upstream trains, its weight gradient ``2 N T`` when it trains):

- towers and projector, per image, and the proprio projector: as OpenVLA's
  (:mod:`.flops`) for each of the ``n`` images;
- the Llama layers over the whole sequence ``S = prefix + t`` with *bidirectional*
  attention: ``4 S^2 d`` per layer forward (the full square; causal counts half);
- the head over the ``K`` chunk steps: ``2 K (D h H + blocks H^2 + H D)``, the lm_head not at
  all;
- training: full fine-tuning ``3 x`` the forward; LoRA: the frozen base ``2 x`` (forward and
  input gradient: adapters sit in every block, so every block passes a gradient back; the
  first patch convolution ``1 x``), the adapters, the head, the projector and FiLM ``3 x``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.oft.batches import OFTBatchBuilder, stage_inputs
from parallax.families.openvla.oft.config import head_rows
from parallax.models.flops import llama_layer_params, vit_components
from parallax.recipe import MetricSpec, TokenObjective

METRIC_SUMS = ("current_l1_sum", "current_count", "next_l1_sum", "next_count")
METRICS = (
    MetricSpec("l1_current", "current_l1_sum", "current_count", "l1 now", ".4f"),
    MetricSpec("l1_next", "next_l1_sum", "next_count", "l1 next", ".4f"),
)


class L1Objective(TokenObjective):
    """OFT's L1 loss over every action element of the global batch (see the module doc)."""

    metric_sums, metrics = METRIC_SUMS, METRICS

    def loss_units(self, mb: Mapping) -> int:
        return int(mb["actions"].numel())  # every action element

    def loss_target(self, run, mb: Mapping):
        return loss_target(run.model_config, mb)  # found on the host

    def loss(self, chunk, output, target, ctx, run):
        return l1_loss(chunk, output, target)


def loss_target(config: OpenVLAConfig, mb: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, actions)``: the head's rows of the flattened hidden states and the normalised
    chunks ``(b, K, D)`` (host tensors)."""
    seq = config.prefix_tokens + mb["input_ids"].shape[1]
    rows = head_rows(mb["prompt_lengths"], seq, config.prefix_tokens, config.oft.slots)
    return rows, mb["actions"]


def l1_loss(chunk, hidden: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of |predicted - true|, metric sums in METRIC_SUMS order)`` of one microbatch,
    from the last stage's hidden states ``(b, S, h)``."""
    rows, actions = target
    picked = hidden.flatten(0, 1).index_select(0, rows)  # (b K D, h)
    pred = chunk.oft_actions(picked).float()  # (b, K, D)
    err = (pred - actions.to(pred.dtype)).abs()  # (b, K, D)
    with torch.no_grad():
        b, k, d = err.shape
        sums = torch.stack(  # counts as fills, not host copies (no stream sync)
            [
                err[:, 0].sum(),
                err.new_full((), float(b * d)),
                err[:, 1:].sum(),
                err.new_full((), float(b * (k - 1) * d)),
            ]
        )
    return err.sum(), sums


@dataclass(frozen=True)
class OFTLoss:
    """OFT's objective of one batch: ``loss`` the mean absolute error over every action element
    (differentiable); ``metrics`` OFT's logged ones, ``l1_current`` (the chunk's first action)
    and ``l1_next`` (the rest; absent for chunks of 1), detached 0-dim tensors."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def oft_loss(model, batch, *, statistics: Mapping | None = None, tokenizer=None) -> OFTLoss:
    """OpenVLA-OFT's L1 objective of ``batch`` without the Trainer: the loss the Trainer
    reports for the same microbatch (its sum over ``b x K x D``), and its metrics.

    ``batch``: raw samples (collated here by :class:`~.batches.OFTBatchBuilder` with
    ``statistics``, else the model's ``norm_stats``, and ``tokenizer``, else the model's) or a
    collated microbatch. OFT's L1 objective has no noise (unlike its DDIM alternative, which
    parallax does not implement): the loss is a deterministic function of the weights and the
    inputs, so there is no noise to pass. ``model``: a whole OFT model on this rank (pp 1; any
    tp, each rank giving the same result); gradients flow, as in training."""
    config = model.config
    if config.oft is None:
        raise ValueError("oft_loss needs an OpenVLA-OFT model (--action-head l1)")
    if not (model.has_vision and model.has_head):
        raise ValueError("oft_loss needs the whole model on this rank: under a pipeline, train")
    mb = batch if isinstance(batch, Mapping) else _collate(model, batch, statistics, tokenizer)
    problem = input_problem(config, mb)
    if problem is not None:
        raise ValueError(f"oft_loss: the microbatch {problem}")
    device = next(model.parameters()).device
    rows, actions = loss_target(config, mb)  # (b K D,), (b, K, D) on the host
    inputs = tuple(x.to(device) for x in stage_inputs(config, mb))
    flag, model.return_hidden = model.return_hidden, True
    try:
        hidden = model(*inputs)  # (b, S, h)
    finally:
        model.return_hidden = flag
    total, sums = l1_loss(model, hidden, (rows.to(device), actions.to(device)))
    metrics = {"l1_current": sums[0] / sums[1]}
    if config.oft.chunk > 1:
        metrics["l1_next"] = sums[2] / sums[3]
    return OFTLoss(total / actions.numel(), metrics)


def _collate(model, samples: Sequence[Mapping], statistics, tokenizer) -> dict:
    stats = statistics if statistics is not None else model.config.norm_stats
    if not stats:
        raise ValueError("oft_loss: raw samples need statistics (the model has no norm_stats)")
    return OFTBatchBuilder(model.config, stats, tokenizer or model.tokenizer)(samples)


def predicted_actions(chunk, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The normalised chunks ``(b, K, D)`` the head gives for these rows (inference)."""
    return chunk.oft_actions(hidden.flatten(0, 1).index_select(0, rows))


def sequence_length(config: OpenVLAConfig, text_tokens: int) -> int:
    return config.prefix_tokens + text_tokens


def forward_parts(config: OpenVLAConfig, text_tokens: int) -> dict[str, float]:
    """Forward FLOPs of one sample by part (module doc): ``vision`` (towers, their attention,
    projector, FiLM, proprio projector), ``llm`` (layers and final norm, attention included)
    and ``head``; ``text_tokens``: input ids, slots and stop token included."""
    oft, t = config.oft, config.text
    h, d, n, p = t.hidden_size, config.vision_dim, oft.num_images, config.num_patches
    vision = 0.0
    for v, name in zip(config.vision, ("dinov2", "siglip")):
        vision += sum(c.flops for c in vit_components(v, name, False).values())  # 2 N T + attn
        if oft.film:
            vision += 2 * 2 * h * v.width * (v.feature_index + 1)  # per image: one vector
    projector = (d * 4 * d + 4 * d * h + h * h) * 2 * p
    vision = n * (vision + projector)
    if oft.use_proprio:
        vision += 2 * (oft.proprio_dim * h + h * h)
    seq = sequence_length(config, text_tokens)
    layers = t.num_hidden_layers
    llm = 2 * seq * (layers * llama_layer_params(t) + h)
    llm += layers * 4.0 * seq * seq * t.num_attention_heads * t.head_dim  # bidirectional
    head = 2 * oft.chunk * (oft.action_dim * h * h + oft.head_blocks * h * h + h * oft.action_dim)
    return {"vision": vision, "llm": llm, "head": head}


def oft_flops_per_sample(config: OpenVLAConfig, text_tokens: int, lora: bool) -> float:
    """Training FLOPs of one sample (module doc)."""
    parts = forward_parts(config, text_tokens)
    base = 2.0 if lora else 3.0
    film = 0.0
    if config.oft.film and lora:  # FiLM trains whole: one more pass for its weight gradient
        film = (
            sum(
                2 * 2 * config.text.hidden_size * v.width * (v.feature_index + 1)
                for v in config.vision
            )
            * config.oft.num_images
        )
    return base * (parts["vision"] + parts["llm"]) + 3.0 * parts["head"] + film


def batch_flops(config: OpenVLAConfig, microbatches: Sequence[Mapping], lora: bool) -> float:
    """Training FLOPs of these microbatches (``input_ids`` ``(b, t)``)."""
    total = 0.0
    for mb in microbatches:
        b, t = mb["input_ids"].shape
        total += b * oft_flops_per_sample(config, t, lora)
    return total


def input_problem(config: OpenVLAConfig, mb: Mapping) -> str | None:
    """What keeps a microbatch from an OFT step, or ``None`` (checked on every rank)."""
    oft = config.oft
    need = ["attention_mask", "action_mask", "prompt_lengths", "actions"]
    need += ["proprio"] if oft.use_proprio else []
    missing = [k for k in need if k not in mb]
    if missing:
        return f"lacks {', '.join(missing)} (an OFT microbatch: OFTBatchBuilder makes them)"
    b = mb["input_ids"].shape[0]
    want = (b, oft.chunk, oft.action_dim)
    if tuple(mb["actions"].shape) != want:
        return f"actions of shape {tuple(mb['actions'].shape)}, expected {want}"
    channels = 6 * oft.num_images
    if mb["pixel_values"].shape[1] != channels:
        return f"pixel_values of {mb['pixel_values'].shape[1]} channels, the model takes {channels}"
    return None
