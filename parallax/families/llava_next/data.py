"""The LLaVA recipe's datasets: what ``--data`` opens and what the length-grouped loader reads.

``--data synthetic`` is the built-in visual question task (:class:`.synthetic.SyntheticVQA`,
its images scaled to the model's tiles); ``--data FILE.json`` (or ``.jsonl``) is a LLaVA
conversation file whose image paths are relative to the file's folder, and
``--data FILE.json:IMAGE_FOLDER`` names the image folder (LLaVA's ``--image_folder``). The
collator that turns samples into microbatches is :mod:`parallax.families.llava_next.batches`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallax.data.stats import DatasetError
from parallax.families.llava_next.batches import LlavaBatches
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.conversations import LlavaConversationDataset
from parallax.families.llava_next.synthetic import SyntheticVQA

SYNTHETIC_TILE = 28  # the synthetic task's image sizes are for llava-tiny's 28 px tiles
SYNTHETIC_SYSTEM = ""  # no system preamble: the tiny model learns the task several times faster
SYNTHETIC_SAMPLES = 2000


def open_dataset(spec: str, config: LlavaNextConfig, seed: int, *, eval_split: bool = False):
    """The dataset ``--data spec`` names (see the module doc); the conversation file is checked
    sample by sample when opened (a :class:`DatasetError` naming the sample)."""
    if spec == "synthetic":
        scale = max(1, config.tile_size // SYNTHETIC_TILE)
        n = SYNTHETIC_SAMPLES // 4 if eval_split else SYNTHETIC_SAMPLES
        return SyntheticVQA(seed=seed + (1 if eval_split else 0), num_samples=n, image_scale=scale)

    path, folder = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith((".json", ".jsonl")):
        path, folder = head, tail
    if not path.endswith((".json", ".jsonl")):
        raise DatasetError(
            f"--data {spec!r}: the llava family reads 'synthetic' or a LLaVA conversation file "
            "(FILE.json or FILE.jsonl, optionally FILE.json:IMAGE_FOLDER)"
        )
    if folder is not None and not Path(folder).is_dir():
        raise DatasetError(f"--data {spec!r}: the image folder {folder} does not exist")
    return LlavaConversationDataset(path, folder)


def sample_lengths(batches: LlavaBatches, dataset: Any) -> tuple[list[int], list[bool]]:
    """Every sample's tokens and whether it has an image, from metadata only (image headers,
    no decoding), for the length-grouped loader; a sample that cannot fit raises here, before
    training."""
    lengths, images = [], []
    for i in range(len(dataset)):
        meta = dataset.meta(i)
        lengths.append(batches.sample_length(meta))
        images.append(meta.get("image_size") is not None)
    return lengths, images
