"""The dual encoders' collator: raw pairs -> microbatches (the sources that ``--data`` opens are
:mod:`parallax.families.siglip.data`).

Bad input, and what happens to it:

- a caption longer than the text tower's ``max_length`` is **truncated** (its first
  ``max_length - 1`` tokens and the end token) and **counted**: ``truncated`` in
  ``metrics.jsonl`` is the share of the step's captions cut, and the first step that cuts any
  logs how many;
- an image of another size than the tower's is **resized** (SigLIP squashes, CLIP crops the
  centre, as their processors do) and counted as ``resized``; ``pixel_values`` of another shape
  handed to the Trainer directly are refused on every rank before any collective
  (:meth:`parallax.families.siglip.recipe.SiglipRecipe.input_problem`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from parallax.data import SyntheticPairs
from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.inputs import (
    TinyTextTokenizer,
    preprocess_images,
    text_tokenizer,
    tokenize,
)

log = logging.getLogger(__name__)

SYNTHETIC_TEMPLATES = ("a {}",)  # the synthetic captions' own wording
DEFAULT_TEMPLATES = ("a photo of a {}.",)


class CharTokenizer(TinyTextTokenizer):
    """Characters at their code points, with the config's end and start ids: the fallback for
    a preset trained from scratch with no tokenizer files (ids < 128 fit every vocabulary)."""

    def __init__(self, eos_id: int, bos_id: int | None) -> None:
        super().__init__(bos_id)
        self.eos_id = self.pad_id = eos_id


def caption_tokenizer(config: SiglipConfig, checkpoint: Path | None):
    """The checkpoint's tokenizer, the tiny presets' built-in one, or characters."""
    tok = text_tokenizer(config, checkpoint)
    if tok is None:
        log.info(
            "no tokenizer files for %s (or the optional tokenizers/sentencepiece package is "
            "missing): captions are tokenized as characters",
            checkpoint or "this preset",
        )
        tok = CharTokenizer(config.text.eos_id, config.text.bos_id)
    return tok


class PairCollator:
    """Raw pairs -> a microbatch: ``pixel_values (m, 3, S, S)``, ``input_ids (m, L)``, the
    counts ``truncated`` and ``resized``, and with labelled data ``labels (m,)`` and the
    zero-shot prompts ``class_ids (C * T, L)`` (``class_templates`` T per class)."""

    def __init__(self, config: SiglipConfig, dataset: Any, checkpoint: Path | None) -> None:
        self.config = config
        self.tokenizer = caption_tokenizer(config, checkpoint)
        self.told = False
        names = _class_names(dataset)
        self.class_ids, self.templates = None, 0
        if names:
            synthetic = isinstance(getattr(dataset, "source", dataset), SyntheticPairs)
            templates = SYNTHETIC_TEMPLATES if synthetic else DEFAULT_TEMPLATES
            prompts = [t.format(n) for n in names for t in templates]
            t = config.text
            self.class_ids, _ = tokenize(self.tokenizer, prompts, t.max_length, t.pad_id)
            self.templates = len(templates)

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        if not samples:
            raise ValueError("cannot build an empty microbatch of pairs")
        s, t = self.config.image_size, self.config.text
        resized = sum(tuple(x["image"].shape[:2]) != (s, s) for x in samples)
        pixel_values = preprocess_images([x["image"] for x in samples], self.config)
        captions = [x["caption"] for x in samples]
        ids, truncated = tokenize(self.tokenizer, captions, t.max_length, t.pad_id)
        if truncated and not self.told:
            log.warning(
                "%d of %d captions are longer than the text tower's %d tokens: truncated "
                "(counted per step as 'truncated' in metrics.jsonl)",
                truncated,
                len(samples),
                t.max_length,
            )
            self.told = True
        mb: dict[str, Any] = {
            "pixel_values": pixel_values,
            "input_ids": ids,
            "truncated": truncated,
            "resized": resized,
        }
        if self.class_ids is not None and all("label" in x for x in samples):
            mb["labels"] = torch.tensor([int(x["label"]) for x in samples])
            mb["class_ids"], mb["class_templates"] = self.class_ids, self.templates
        return mb


def _class_names(dataset: Any) -> list[str] | None:
    names = getattr(dataset, "class_names", None)
    return names() if callable(names) else None
