"""LLaVA-NeXT's blocks as the planner sees them (:mod:`parallax.models.estimate`), for the
worst case a batch is padded to: an image of the most tiles (5 for LLaVA-v1.6: the base image
and a 2 x 2 grid) and its most image tokens, plus a typical conversation's text."""

from __future__ import annotations

from parallax.families.llava_next.config import LlavaNextConfig
from parallax.models.estimate import (
    BlockEstimate,
    Linear,
    decoder_model,
    embedding,
    linears,
    llama_layer,
    lm_head,
    vision_tower,
)

TYPICAL_TEXT_TOKENS = 100
TYPICAL_ANSWER_TOKENS = 50  # the labelled positions of such a text


def sequence(config: LlavaNextConfig) -> int:
    """Tokens of the worst-case sample: its image tokens and a typical text."""
    return min(config.max_length, config.max_image_tokens + TYPICAL_TEXT_TOKENS)


def block_estimates(config: LlavaNextConfig, run) -> list[BlockEstimate]:
    e = 2 if run.precision == "bf16" else 4
    v, text, tiles = config.vision, config.text, config.max_tiles
    seq, h = sequence(config), text.hidden_size
    hidden = seq * h * e  # (t, h): what every stage hands on
    projector = [  # linear_1 column-parallel, GELU, linear_2 row-parallel
        Linear(v.width, h, sharded_out=True, act=True),
        Linear(h, h, sharded_in=True),
    ]
    first = (
        *vision_tower(v, e, images=tiles),
        linears("projector", tiles * v.num_patches, projector, e),
        embedding(seq, h, e),
    )
    rows = TYPICAL_ANSWER_TOKENS if run.logits == "labelled" else seq
    layer, head = llama_layer(text, seq, e), lm_head(text, rows, e)
    return decoder_model(first, layer, text.num_hidden_layers, head, hidden)
