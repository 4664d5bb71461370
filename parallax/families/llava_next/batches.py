"""The LLaVA recipe's collator: samples -> microbatches (the datasets that ``--data`` opens are
:mod:`parallax.families.llava_next.data`).

A microbatch is the processor's right-padded batch (:meth:`LlavaNextProcessor.collate`) plus
``lengths (b,)`` (each sample's real tokens: text and image) and ``num_tiles (b,)`` (the tiles
its image runs through the tower; 0 without an image), which the FLOP and token counts read so
that padding is never counted as useful work.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.processor import LlavaNextProcessor
from parallax.families.llava_next.template import LlavaTinyTokenizer, llava_tokenizer

log = logging.getLogger(__name__)


def text_tokenizer(config: LlavaNextConfig, checkpoint: Path | None):
    """The checkpoint's tokenizer, the built-in one of ``llava-tiny``, or (a randomly
    initialised 7B preset) the character tokenizer, whose ids fit any vocabulary."""
    tok = llava_tokenizer(config, checkpoint, required=checkpoint is not None)
    if tok is None:
        log.info("no tokenizer for this model: using the built-in character-level tokenizer")
        tok = LlavaTinyTokenizer()
    return tok


class LlavaBatches:
    """Raw samples -> one microbatch (the processor's tensors, ``lengths`` and ``num_tiles``)."""

    def __init__(self, config: LlavaNextConfig, tokenizer, *, system: str | None = None) -> None:
        self.config = config
        self.processor = LlavaNextProcessor(config, tokenizer, system=system)

    def sample_length(self, meta: dict) -> int:
        """Tokens of a sample from its metadata (no pixels): raises ``ValueError`` naming the
        sample when its image tokens do not fit the maximum length."""
        return self.processor.sample_length(meta)

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        encoded = [self.processor.encode(s) for s in samples]
        mb = self.processor.collate(encoded)
        cfg = self.config
        mb["lengths"] = torch.tensor([len(e["input_ids"]) for e in encoded], dtype=torch.long)
        mb["num_tiles"] = torch.tensor(
            [
                0
                if e["image_size"] is None
                else anyres.num_tiles(e["image_size"], cfg.image_grid_pinpoints, cfg.tile_size)
                for e in encoded
            ],
            dtype=torch.long,
        )
        return mb


def sample_counts(config: LlavaNextConfig, mb: dict) -> tuple[list[int], list[int]]:
    """Each sample's real tokens and tiles: the collator's ``lengths`` and ``num_tiles``, or
    (a microbatch made by the processor alone) read from the padding and ``image_sizes``."""
    if "lengths" in mb and "num_tiles" in mb:
        return mb["lengths"].tolist(), mb["num_tiles"].tolist()
    ids = mb["input_ids"]
    real = ids != config.pad_token_id
    lengths = torch.where(real.any(1), real.int().cumsum(1).argmax(1) + 1, 0).tolist()
    tiles = [
        0
        if (h, w) == (0, 0)
        else anyres.num_tiles((h, w), config.image_grid_pinpoints, config.tile_size)
        for h, w in mb["image_sizes"].tolist()
    ]
    return lengths, tiles
