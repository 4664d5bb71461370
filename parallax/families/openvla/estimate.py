"""OpenVLA's blocks as the planner sees them (:mod:`parallax.models.estimate`): per sample, the
two towers over the image, the fused GELU projector, the Llama layers over the patches and a
typical prompt with its action, and the head over the labelled positions.

The prompt: 41 tokens (BOS, an instruction of robot data in Llama-2's tokenizer, the 7 action
tokens and EOS); for the built-in synthetic task, what its collator really makes of a few
samples (the character-level tokenizer of a randomly initialised preset makes them longer)."""

from __future__ import annotations

from parallax.data import SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.families.openvla.config import OpenVLAConfig
from parallax.models.estimate import (
    BlockEstimate,
    Linear,
    embedding,
    linears,
    llama_layer,
    lm_head,
    vit_blocks,
    vit_stem,
)

TEXT_TOKENS = 41  # BOS, a typical instruction prompt and the 7 action tokens and EOS
LABELLED = 8  # the 7 action tokens and EOS carry the loss


def text_tokens(config: OpenVLAConfig, cfg) -> int:
    """The text tokens a sample brings (see the module docstring)."""
    if cfg.data != "synthetic":
        return TEXT_TOKENS
    key = (config.image_size, config.tokenizer, config.text.vocab_size, cfg.seed, cfg.checkpoint)
    if key not in _SYNTHETIC:
        data = SyntheticTask(seed=cfg.seed, image_size=config.image_size)
        batch = BatchBuilder(config, data.statistics, text_tokenizer(config, cfg.checkpoint))
        _SYNTHETIC[key] = int(batch([data[i] for i in range(8)])["input_ids"].shape[1])
    return _SYNTHETIC[key]


_SYNTHETIC: dict[tuple, int] = {}  # the synthetic task's prompt length per tokenizer


def block_estimates(config: OpenVLAConfig, cfg) -> list[BlockEstimate]:
    e = 2 if cfg.precision == "bf16" else 4
    text, p = config.text, config.num_patches
    tokens = text_tokens(config, cfg)
    seq = p + tokens
    hidden = seq * text.hidden_size * e  # (P + t, h): what every stage hands on
    parts = []
    for tower in config.vision:
        parts.append(vit_stem(tower, e))
        tokens = tower.num_patches + tower.num_prefix_tokens
        parts.append(vit_blocks(tower, tokens, e, tower.feature_index + 1, "vision"))
    d, h = config.vision_dim, text.hidden_size
    projector = [  # fc1 column-parallel, fc2 and fc3 row-parallel, GELU after fc1 and fc2
        Linear(d, 4 * d, sharded_out=True, act=True),
        Linear(4 * d, h, sharded_in=True, act=True),
        Linear(h, h),
    ]
    parts += [linears("projector", p, projector, e), embedding(tokens, h, e)]
    rows = LABELLED if cfg.logits == "labelled" else seq
    return (
        [BlockEstimate(tuple(parts), hidden)]
        + [BlockEstimate((llama_layer(text, seq, e),), hidden)] * text.num_hidden_layers
        + [BlockEstimate((lm_head(text, rows, e),), 0.0)]
    )
