"""Raw samples (image, instruction, action) -> the tensors OpenVLA trains on.

As OpenVLA's own pipeline does: actions are normalised with the dataset's q01/q99 bounds and
turned into action tokens, the prompt ``In: What action should the robot take to {instruction}?
Out:`` is tokenised, only the D action tokens (7 for OpenVLA) and the closing EOS carry labels,
sequences are right-padded with the pad id (labels -100), and the image is resized and
normalised for both vision towers (6 channels).

The action dimension D is the dataset's (its statistics); a model checkpoint whose
``norm_stats`` were computed on actions of another dimension cannot take it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from parallax.families.openvla.action_tokenizer import ActionTokenizer, normalize_actions
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.preprocess import pixel_values
from parallax.families.openvla.prompt import TinyTokenizer, get_tokenizer, training_example
from parallax.models.tokenizer import IGNORE_INDEX

log = logging.getLogger(__name__)


def text_tokenizer(config: OpenVLAConfig, checkpoint_dir=None):
    """The checkpoint's tokenizer when one can be loaded, else parallax's character-level one.

    The fallback keeps every id below 256, so it fits any vocabulary; it is what the ``tiny``
    preset uses and what a randomly initialised ``openvla-7b`` can train on. A real OpenVLA
    checkpoint needs its own tokenizer (``pip install tokenizers``).
    """
    tok = get_tokenizer(config, checkpoint_dir)
    if tok is not None:
        return tok
    if checkpoint_dir is not None:
        raise ValueError(
            f"cannot load the tokenizer of {checkpoint_dir}: install the optional `tokenizers` "
            "(or `sentencepiece`) package, and make sure tokenizer.json is in the directory"
        )
    log.info("no text tokenizer for this model: using the built-in character-level tokenizer")
    return TinyTokenizer()


def action_dim(stats: Mapping) -> int:
    """The dimension of the actions one dataset's ``norm_stats`` entry describes."""
    return len(stats["action"]["q01"])


def check_action_dim(config: OpenVLAConfig, stats: Mapping) -> None:
    """Each dataset's actions must have a dimension the model's statistics know (any, when it
    has none: a preset); raises ``ValueError`` naming both and where each comes from."""
    for name, entry in stats.items():
        _check_one(config, name, entry)


def _check_one(config: OpenVLAConfig, name: str, entry: Mapping) -> None:
    data_dim = action_dim(entry)
    model_dims = {key: action_dim(s) for key, s in config.norm_stats.items() if "action" in s}
    if not model_dims or data_dim in model_dims.values():
        return
    where = f"checkpoint {config.source}" if config.source else "the model"
    keys = ", ".join(f"{k} ({d})" for k, d in sorted(model_dims.items())[:3])
    more = ", ..." if len(model_dims) > 3 else ""
    dims = " or ".join(map(str, sorted(set(model_dims.values()))))
    raise ValueError(
        f"dataset {name!r} has {data_dim}-dimensional actions (its dataset statistics), but "
        f"{where} was made for {dims}-dimensional ones (the norm_stats of its config.json: "
        f"{keys}{more}); convert the data with actions of that dimension, or train a preset "
        "(--model tiny, small or openvla-7b: no statistics, any dimension)"
    )


class BatchBuilder:
    """Turns lists of raw samples into ``{"pixel_values", "input_ids", "labels"}`` tensors.

    ``stats`` holds one dataset's statistics, or a mixture's (one entry per dataset): a
    sample is normalised with those of its ``"dataset"``."""

    def __init__(self, config: OpenVLAConfig, stats: Mapping, tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.action_tokenizer = ActionTokenizer.from_config(config)
        if not stats:
            raise ValueError("expected the statistics of at least one dataset, got none")
        check_action_dim(config, stats)
        self.by_dataset = {name: entry["action"] for name, entry in stats.items()}
        self.action_stats = next(iter(self.by_dataset.values()))

    def stats_of(self, sample: Mapping) -> Mapping:
        """The action statistics of the sample's dataset."""
        if len(self.by_dataset) == 1:
            return self.action_stats
        name = sample.get("dataset")
        if name not in self.by_dataset:
            raise ValueError(
                f"a sample of dataset {name!r} but statistics of {sorted(self.by_dataset)}"
            )
        return self.by_dataset[name]

    def __call__(self, samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        ids, labels = [], []
        for s in samples:
            stats = self.stats_of(s)
            action = np.asarray(s["action"], dtype=np.float64)
            if action.shape != (len(stats["q01"]),):
                raise ValueError(
                    f"{s.get('dataset', 'the dataset')!r}: an action of shape {action.shape} "
                    f"but statistics of {len(stats['q01'])} dimensions"
                )
            action = normalize_actions(action, stats)
            i, lab = training_example(
                self.tokenizer, self.action_tokenizer, s["instruction"], action
            )
            ids.append(i)
            labels.append(lab)
        width = padded_width(max(len(i) for i in ids), self.config.text_multiple)
        pad = self.config.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        label_t = torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long)
        for row, (i, lab) in enumerate(zip(ids, labels)):
            input_ids[row, : len(i)] = torch.tensor(i)
            label_t[row, : len(lab)] = torch.tensor(lab)
        images = [torch.as_tensor(s["image"]) for s in samples]
        return {
            "pixel_values": pixel_values(images, self.config),  # (b, 6, S, S)
            "input_ids": input_ids,  # (b, t)
            "labels": label_t,  # (b, t)
        }


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``: a compiled block recompiles, and a
    CUDA graph records again, for every new width; few widths, few of both."""
    return -(-width // multiple) * multiple
