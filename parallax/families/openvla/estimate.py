"""OpenVLA's blocks as the planner sees them (:mod:`parallax.models.estimate`): per sample, the
two towers over each image, the fused GELU projector, the Llama layers over the patches and a
typical prompt with its action, and the head: the lm_head over the labelled positions, or with
OFT (``--action-head l1``) the L1 regression head over the action slots.

The prompt: 41 tokens (BOS, an instruction of robot data in Llama-2's tokenizer, the 7 action
tokens and EOS; with OFT the chunk's action slots and the stop token instead of the action
tokens); for the built-in synthetic task, what its collator really makes of a few samples (the
character-level tokenizer of a randomly initialised preset makes them longer)."""

from __future__ import annotations

import dataclasses

from parallax.families.openvla.batches import padded_width
from parallax.families.openvla.config import OpenVLAConfig
from parallax.models.estimate import (
    BlockEstimate,
    Linear,
    Part,
    Split,
    decoder_model,
    embedding,
    linears,
    llama_layer,
    lm_head,
    vision_tower,
)

TEXT_TOKENS = 41  # BOS, a typical instruction prompt and the 7 action tokens and EOS
LABELLED = 8  # the 7 action tokens and EOS carry the loss
_SYNTHETIC: dict[tuple, int] = {}  # the synthetic task's token ids per sample, per tokenizer


def text_tokens(data, run) -> int:
    """Token ids per sample (BOS, prompt, actions or OFT's slots and stop) of ``run``'s model,
    the synthetic task's as ``data`` (the recipe's data side) makes them: see the module
    docstring."""
    config: OpenVLAConfig = run.model_config
    if run.data != "synthetic":  # a typical width, rounded up as --pad-to-multiple-of asks
        oft = config.oft
        typical = TEXT_TOKENS if oft is None else TEXT_TOKENS - LABELLED + oft.slots + 1
        return padded_width(typical, config.text_multiple)
    key = (repr(config.oft), config.image_size, config.tokenizer, config.text.vocab_size)
    key += (run.seed, run.checkpoint, config.text_multiple)
    if key not in _SYNTHETIC:
        dataset = data.dataset("synthetic", run)
        batch = data.collator(run, dataset)
        _SYNTHETIC[key] = int(batch([dataset[i] for i in range(8)])["input_ids"].shape[1])
    return _SYNTHETIC[key]


def block_estimates(model, run) -> list[BlockEstimate]:
    """What one sample keeps and computes per block of ``run``'s model (``model``: the
    recipe's model side, whose data side makes the synthetic task's samples)."""
    config: OpenVLAConfig = run.model_config
    e = 2 if run.precision == "bf16" else 4
    text, oft = config.text, config.oft
    images = 1 if oft is None else oft.num_images
    tokens = text_tokens(model.data, run)
    seq = config.prefix_tokens + tokens
    hidden = seq * text.hidden_size * e  # (prefix + t, h): what every stage hands on
    parts = []
    for tower in config.vision:
        parts += vision_tower(tower, e, images=images)
    d, h, p = config.vision_dim, text.hidden_size, config.num_patches * images
    projector = [  # fc1 column-parallel, fc2 and fc3 row-parallel, GELU after fc1 and fc2
        Linear(d, 4 * d, sharded_out=True, act=True),
        Linear(4 * d, h, sharded_in=True, act=True),
        Linear(h, h),
    ]
    parts += [linears("projector", p, projector, e), embedding(tokens, h, e)]
    layer = llama_layer(text, seq, e)
    if oft is not None:  # bidirectional attention: every score computed
        layer = _bidirectional(layer)
    return decoder_model(parts, layer, text.num_hidden_layers, _head(model, run, seq, e), hidden)


def _bidirectional(layer: Part) -> Part:
    return dataclasses.replace(layer, attention_flops=2 * layer.attention_flops)


def _head(model, run, seq: int, e: int) -> Part:
    """The lm_head over the labelled rows (or all), or OFT's L1 head over the action slots:
    the final norm and its MLP-ResNet keep a few activations of the slots' width."""
    config: OpenVLAConfig = run.model_config
    if config.oft is None:
        return lm_head(config.text, LABELLED if run.logits == "labelled" else seq, e)
    rows, h = config.oft.slots, config.text.hidden_size
    saved = Split(0.0, rows * h * e * (2 + 2 * config.oft.head_blocks) + rows * h * 4)
    flops = model.blocks(config)[-1].cost  # its forward, as the pipeline split counts it
    # mostly plain nn.Linear (and the LM head's share): no FP8 counted under --fp8
    return Part("L1 action head", saved=saved, gemm_flops=flops, tokens=rows, fp8=False)
