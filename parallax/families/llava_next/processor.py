"""LLaVA-NeXT's processor: images -> AnyRes tiles, conversations -> ids and labels, batches.

Images (uint8 ``(H, W, 3)``, float ``(3, H, W)`` in [0, 1], or a PIL image) go through
transformers' LLaVA-NeXT steps in torch: the best canvas, an aspect-preserving bicubic resize,
centring on a black canvas, ``S``-pixel tiles row-major after a squashed ``S x S`` base image,
then CLIP's normalisation. The resize is ``F.interpolate(bicubic, antialias=True)`` (uint8
inputs rounded back to uint8 as PIL does), which follows PIL's filter closely but not bit for bit.

A batch is right-padded (see :meth:`LlavaNextProcessor.collate`): ``input_ids`` with the pad id
and ``labels`` with -100 up to the longest sample, ``pixel_values`` with zero tiles up to the
most tiles of any sample, and ``image_sizes`` ``(0, 0)`` for a sample without an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.conversations import conversation_turns
from parallax.families.llava_next.template import encode_conversation, llava_tokenizer, prompt_ids
from parallax.models.images import as_chw_float
from parallax.models.tokenizer import IGNORE_INDEX


def _resize(x: torch.Tensor, size: tuple[int, int], is_uint8: bool) -> torch.Tensor:
    if tuple(x.shape[1:]) == tuple(size):
        return x
    y = F.interpolate(x[None], size=size, mode="bicubic", antialias=True, align_corners=False)[0]
    return y.round().clamp(0, 255) if is_uint8 else y.clamp(0, 1)


class LlavaNextProcessor:
    """Turns raw samples (``{"id", "image", "conversations"}``, the LLaVA format) into model
    inputs. ``max_length`` (default: the config's) bounds a sample's tokens: a longer sample is
    cut (as LLaVA truncates) unless its image tokens themselves do not fit, which is an error.
    ``template`` and ``system`` choose the prompt (:mod:`parallax.families.llava_next.template`)."""

    def __init__(
        self,
        config: LlavaNextConfig,
        tokenizer=None,
        *,
        template: str = "vicuna_v1",
        system: str | None = None,
        max_length: int | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = (
            tokenizer if tokenizer is not None else llava_tokenizer(config, required=True)
        )
        self.template, self.system = template, system
        self.max_length = max_length or config.max_length

    # -- images ----------------------------------------------------------------------------------
    def image_size(self, image) -> tuple[int, int]:
        x, _ = as_chw_float(image)
        return int(x.shape[1]), int(x.shape[2])

    def preprocess_image(self, image) -> tuple[torch.Tensor, tuple[int, int]]:
        """One image -> ``(tiles (1 + gh * gw, 3, S, S), (height, width))``."""
        cfg, s = self.config, self.config.tile_size
        x, is_uint8 = as_chw_float(image)  # (3, H, W), 0..255 for uint8
        size = (int(x.shape[1]), int(x.shape[2]))
        ch, cw = anyres.select_best_resolution(size, cfg.image_grid_pinpoints)
        nh, nw = anyres.resized_size(size, (ch, cw))
        canvas = x.new_zeros(3, ch, cw)  # black
        top, left = (ch - nh) // 2, (cw - nw) // 2
        canvas[:, top : top + nh, left : left + nw] = _resize(x, (nh, nw), is_uint8)
        tiles = canvas.unfold(1, s, s).unfold(2, s, s)  # (3, gh, gw, S, S)
        tiles = tiles.permute(1, 2, 0, 3, 4).reshape(-1, 3, s, s)  # row-major
        out = torch.cat([_resize(x, (s, s), is_uint8)[None], tiles])  # (1 + gh * gw, 3, S, S)
        if is_uint8:
            out = out / 255.0
        mean = torch.tensor(cfg.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(cfg.image_std).view(1, 3, 1, 1)
        return (out - mean) / std, size

    def num_image_tokens(self, size: tuple[int, int] | None) -> int:
        if size is None:
            return 0
        cfg = self.config
        return anyres.num_image_tokens(size, cfg.image_grid_pinpoints, cfg.tile_size, cfg.tile_side)

    # -- text ------------------------------------------------------------------------------------
    def encode_text(self, conversations, size: tuple[int, int] | None, sample_id: Any = None):
        """``(input_ids, labels)`` of one sample whose image (if any) has ``size``."""
        turns = conversation_turns(conversations, has_image=size is not None, sample_id=sample_id)
        n = self.num_image_tokens(size)
        ids, labels = encode_conversation(
            turns,
            self.tokenizer,
            image_tokens=n,
            image_token_id=self.config.image_token_index,
            template=self.template,
            system=self.system,
        )
        if len(ids) > self.max_length:
            if n and ids.index(self.config.image_token_index) + n > self.max_length:
                raise ValueError(
                    f"sample {sample_id!r}: its image of {size[0]}x{size[1]} gives {n} tokens, "
                    f"which end past the maximum length {self.max_length}"
                )
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        return ids, labels

    def sample_length(self, meta: dict) -> int:
        """Tokens of a sample from ``{"id", "image_size", "conversations"}`` (no pixels)."""
        ids, _ = self.encode_text(meta["conversations"], meta.get("image_size"), meta.get("id"))
        return len(ids)

    # -- samples and batches ---------------------------------------------------------------------
    def encode(self, sample: dict) -> dict[str, Any]:
        """One raw sample -> ``{"pixel_values" (n, 3, S, S) or None, "image_size",
        "input_ids", "labels"}``."""
        tiles, size = (None, None)
        if sample.get("image") is not None:
            tiles, size = self.preprocess_image(sample["image"])
        ids, labels = self.encode_text(sample["conversations"], size, sample.get("id"))
        return {"pixel_values": tiles, "image_size": size, "input_ids": ids, "labels": labels}

    def collate(self, encoded: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Right-pad encoded samples into ``{"pixel_values" (b, T, 3, S, S), "image_sizes"
        (b, 2), "input_ids" (b, t), "labels" (b, t)}`` (at least one tile, so a batch without
        images still has the usual shapes; the model never runs zero tiles)."""
        if not encoded:
            raise ValueError("cannot collate an empty batch")
        s = self.config.tile_size
        b, t = len(encoded), max(len(e["input_ids"]) for e in encoded)
        tiles = max(
            [1] + [e["pixel_values"].shape[0] for e in encoded if e["pixel_values"] is not None]
        )
        pixel_values = torch.zeros(b, tiles, 3, s, s)
        image_sizes = torch.zeros(b, 2, dtype=torch.long)
        input_ids = torch.full((b, t), self.config.pad_token_id, dtype=torch.long)
        labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        for i, e in enumerate(encoded):
            if e["pixel_values"] is not None:
                pixel_values[i, : e["pixel_values"].shape[0]] = e["pixel_values"]
                image_sizes[i] = torch.tensor(e["image_size"])
            input_ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
            labels[i, : len(e["labels"])] = torch.tensor(e["labels"])
        return {
            "pixel_values": pixel_values,
            "image_sizes": image_sizes,
            "input_ids": input_ids,
            "labels": labels,
        }

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        return self.collate([self.encode(s) for s in samples])

    def prompt(self, image, question: str, template: str | None = None) -> dict[str, torch.Tensor]:
        """Generation inputs for one image (or ``None``) and question: a batch of one, in the
        training template unless ``template`` is given (LLaVA's own inference uses
        ``llava_v1``)."""
        tiles, size = (None, None) if image is None else self.preprocess_image(image)
        ids = prompt_ids(
            (question if image is None or "<image>" in question else "<image>\n" + question),
            self.tokenizer,
            image_tokens=self.num_image_tokens(size),
            image_token_id=self.config.image_token_index,
            template=template or self.template,
            system=self.system,
        )
        s = self.config.tile_size
        return {
            "pixel_values": (tiles if tiles is not None else torch.zeros(1, 3, s, s))[None],
            "image_sizes": torch.tensor([list(size) if size else [0, 0]]),
            "input_ids": torch.tensor([ids]),
        }

    def decode(self, ids) -> str:
        """Text of generated ids, up to the first ``</s>``."""
        ids = [int(i) for i in ids]
        eos = self.tokenizer.eos_id
        return self.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids).strip()
