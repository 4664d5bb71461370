"""Inputs of the dual encoders: caption tokenizers and image preprocessing, in torch.

Captions: SigLIP's SentencePiece tokenizer (``spiece.model``, the optional ``sentencepiece``
package) lower-cases, drops punctuation, collapses whitespace and appends ``</s>``; CLIP's BPE
(``tokenizer.json``, the optional ``tokenizers`` package) adds its start and end tokens; the tiny
presets use a built-in character tokenizer. Every caption becomes exactly ``max_length`` ids,
padded with ``pad_id``. **A caption longer than that is truncated** to its first
``max_length - 1`` tokens plus the end token, and counted (:func:`tokenize` returns the count;
the data pipeline logs it): the towers' position embeddings end there.

Images: SigLIP resizes to the square (aspect ratio not kept), CLIP resizes the shortest side and
crops the centre; both then scale to [0, 1] and normalise (SigLIP mean = std = 0.5, CLIP's own
statistics). ``strict=True`` refuses an image of another size instead of resizing it.
"""

from __future__ import annotations

import importlib
import logging
import re
import string
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from parallax.families.siglip.config import SiglipConfig
from parallax.models.images import as_chw_float

log = logging.getLogger(__name__)


class TinyTextTokenizer:
    """Lower-case characters: 0 unk, 1 end (and pad), 2 start, printable ASCII at its code
    points; vocabulary 128. Adds the start token only when ``bos_id`` is given (tiny CLIP)."""

    vocab_size, unk_id, eos_id, pad_id = 128, 0, 1, 1

    def __init__(self, bos_id: int | None = None) -> None:
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) if 32 <= ord(c) < 127 else self.unk_id for c in text.lower()]
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]


def _optional(package: str, family: str) -> ModuleType:
    """The optional package (the tokenizers extra) that ``family``'s tokenizer reads with."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"{family}'s tokenizer needs the optional {package!r} package "
            "(pip install -e '.[tokenizers]'); without it, pass token ids"
        ) from err


def _tokenizer_file(path: str | Path, name: str) -> Path:
    file = Path(path) / name
    if not file.is_file():
        raise FileNotFoundError(f"no {name} in {path}")
    return file


class SentencePieceTokenizer:
    """SigLIP's tokenizer from ``spiece.model`` (needs ``sentencepiece``)."""

    def __init__(self, path: str | Path) -> None:
        sentencepiece = _optional("sentencepiece", "SigLIP")
        file = _tokenizer_file(path, "spiece.model")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self.pad_id = self._sp.piece_to_id("</s>")
        self.bos_id = None

    @staticmethod
    def canonicalize(text: str) -> str:
        text = text.lower().translate(str.maketrans("", "", string.punctuation))
        return re.sub(r"\s+", " ", text).strip()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(self.canonicalize(text))) + [self.eos_id]


class BPETokenizer:
    """CLIP's tokenizer from ``tokenizer.json`` (needs ``tokenizers``); its post-processor adds
    the start and end tokens."""

    def __init__(self, path: str | Path, eos_id: int) -> None:
        tokenizers = _optional("tokenizers", "CLIP")
        file = _tokenizer_file(path, "tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self.pad_id = eos_id
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids
        return ids if ids and ids[-1] == self.eos_id else ids + [self.eos_id]


def text_tokenizer(config: SiglipConfig, path: str | Path | None = None):
    """The tokenizer of ``config``; ``None`` when its files or optional package are missing."""
    if config.tokenizer == "tiny":
        return TinyTextTokenizer(config.text.bos_id)
    path = path or config.source
    if path is None:
        return None
    try:
        if config.tokenizer == "sentencepiece":
            return SentencePieceTokenizer(path)
        return BPETokenizer(path, config.text.eos_id)
    except (ImportError, FileNotFoundError):
        return None


def tokenize(
    tokenizer, texts: Sequence[str], max_length: int, pad_id: int | None = None
) -> tuple[torch.Tensor, int]:
    """``(ids (n, max_length) int64, number of captions truncated)``; see the module doc."""
    pad = tokenizer.pad_id if pad_id is None else pad_id
    out = torch.full((len(texts), max_length), pad, dtype=torch.long)
    truncated = 0
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if len(ids) > max_length:
            ids = ids[: max_length - 1] + ids[-1:]  # keep the end token
            truncated += 1
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out, truncated


def _resize_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """Shortest side to ``size`` (bicubic, antialiased), then the centre ``size x size``."""
    h, w = x.shape[1:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(x[None], size=(nh, nw), mode="bicubic", antialias=True)[0]
    top, left = (nh - size) // 2, (nw - size) // 2
    return x[:, top : top + size, left : left + size]


def preprocess_image(image, config: SiglipConfig, strict: bool = False) -> torch.Tensor:
    """One image (uint8 ``(H, W, 3)``, float ``(3, H, W)`` in [0, 1], or PIL) -> ``(3, S, S)``."""
    x, is_uint8 = as_chw_float(image)
    s = config.image_size
    if min(x.shape[1:]) < 1:
        raise ValueError(f"empty image of shape {tuple(x.shape)}")
    if tuple(x.shape[1:]) != (s, s):
        if strict:
            raise ValueError(
                f"image is {x.shape[2]}x{x.shape[1]} (w x h) but the model takes {s}x{s}; "
                "resize it, or preprocess with strict=False to resize here"
            )
        if config.resize == "crop":
            x = _resize_crop(x, s)
        else:
            x = F.interpolate(x[None], size=(s, s), mode="bicubic", antialias=True)[0]
        x = x.round().clamp(0, 255) if is_uint8 else x.clamp(0, 1)
    if is_uint8:
        x = x / 255.0
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)
    return (x - mean) / std


def preprocess_images(images, config: SiglipConfig, strict: bool = False) -> torch.Tensor:
    """A list of images -> ``(b, 3, S, S)`` float32 pixel values."""
    return torch.stack([preprocess_image(i, config, strict) for i in images])


def pair_batch(
    samples, config: SiglipConfig, tokenizer, strict: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Raw pairs (``{"image", "caption"}``) -> ``(pixel_values (b, 3, S, S), input_ids (b, L),
    captions truncated)`` for :class:`~parallax.models.Siglip`."""
    if not samples:
        raise ValueError("cannot build an empty batch of pairs")
    pixel_values = preprocess_images([s["image"] for s in samples], config, strict)
    t = config.text
    ids, truncated = tokenize(tokenizer, [s["caption"] for s in samples], t.max_length, t.pad_id)
    if truncated:
        log.info("%d of %d captions truncated to %d tokens", truncated, len(samples), t.max_length)
    return pixel_values, ids, truncated
