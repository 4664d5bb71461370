"""Inference: greedy decoding of the action tokens with a KV cache, and ``predict_action``.

The prompt (``[BOS] In: What action should the robot take to {instruction}?\\nOut: ▁``) and the
image are run once; each further action token costs one cached decoder step over one token.
Under tensor parallelism every tp rank runs this with the same inputs and the argmax is taken
across the vocabulary shards without gathering the logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from parallax.data.augment import center_crop
from parallax.families.openvla.action_tokenizer import unnormalize_actions
from parallax.families.openvla.batches import check_action_dim
from parallax.families.openvla.preprocess import pixel_values as to_pixel_values
from parallax.families.openvla.prompt import prompt_ids
from parallax.models.llama import KVCache
from parallax.tensor.loss import tp_argmax

LLAMA2_SPACE_ID = 29871  # SentencePiece "▁", which precedes the action tokens


@torch.no_grad()
def generate(
    model,
    pixel_values: torch.Tensor,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    use_cache: bool = True,
) -> torch.Tensor:
    """Greedy continuation ``(b, max_new_tokens)`` of ``input_ids`` (b, t) given the image."""
    if not (model.has_vision and model.has_head):
        raise ValueError(
            f"generation needs the whole model on this rank (pp=1); it holds {model.block_names[0]}"
            f"..{model.block_names[-1]}"
        )
    lm, vocab = model.language_model, model.config.text.vocab_size
    out = []
    if use_cache:
        cache = KVCache()
        first = int(next(iter(lm.model.layers))) if len(lm.model.layers) else 0
        x = lm.forward_layers(model.embed(pixel_values, input_ids), cache)  # (b, s, h)
        logits = lm.head(x[:, -1:])  # (b, 1, V/tp)
        for step in range(max_new_tokens):
            token = tp_argmax(logits[:, -1], model.ctx, vocab)  # (b,)
            out.append(token)
            if step + 1 < max_new_tokens:
                x = lm.forward_layers(lm.embed(token[:, None]), cache, start=cache.length(first))
                logits = lm.head(x)  # (b, 1, V/tp)
    else:
        ids = input_ids
        for _ in range(max_new_tokens):
            token = tp_argmax(model(pixel_values, ids)[:, -1], model.ctx, vocab)  # (b,)
            out.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(out, dim=1)


def predict_action(
    model,
    image,
    instruction: str | None = None,
    unnorm_key: str | None = None,
    *,
    tokenizer=None,
    input_ids=None,
    use_cache: bool = True,
    statistics=None,
    center_crop: bool | float = False,
) -> np.ndarray:
    """The continuous action for one image and instruction (or prompt ``input_ids``).

    ``image``: uint8 ``(H, W, 3)`` array or tensor, float ``(3, H, W)`` in [0, 1], or a PIL
    image. Actions are un-normalised with ``norm_stats[unnorm_key]``; without statistics the
    normalised action in [-1, 1] is returned. ``statistics`` (a ``dataset_statistics.json``
    path, as training writes to its ``--out``, or its dict) replaces the model's
    ``norm_stats``; their action dimension must be one the model's own statistics know.
    ``center_crop``: the central 90% of the area (or this fraction), resized back, as OpenVLA
    evaluates a model trained with its augmentation (``--augment``).
    """
    config = model.config
    if statistics is not None:
        config = config_with_statistics(config, statistics)
    if center_crop:
        image = _center_crop(image, 0.9 if center_crop is True else float(center_crop))
    tokenizer = tokenizer or model.tokenizer
    if input_ids is None:
        if tokenizer is None or instruction is None:
            raise ValueError(
                "predict_action needs an instruction and a tokenizer (install the optional "
                "'tokenizers' package for the checkpoint's own), or prompt input_ids"
            )
        ids = prompt_ids(tokenizer, instruction)
    else:
        ids = [int(i) for i in input_ids]
        space = tokenizer.action_space_id if tokenizer is not None else LLAMA2_SPACE_ID
        if ids[-1] != space:
            ids.append(space)
    stats = config.action_stats(unnorm_key)
    action_dim = len(stats["q01"]) if stats is not None else 7
    param = next(model.parameters())
    px = to_pixel_values(image, model.config).to(param.device)
    ids_t = torch.tensor([ids], dtype=torch.long, device=param.device)
    tokens = generate(model, px, ids_t, action_dim, use_cache=use_cache)[0]
    normalized = model.action_tokenizer.decode(tokens.cpu().numpy())
    return normalized if stats is None else unnormalize_actions(normalized, stats)


def config_with_statistics(config, statistics):
    """``config`` with ``statistics`` (a path or a ``norm_stats`` dict) as its norm_stats."""
    if isinstance(statistics, str | Path):
        path = Path(statistics)
        if path.is_dir():
            path = path / "dataset_statistics.json"
        try:
            statistics = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"statistics {path}: cannot read it ({err})") from None
    if not isinstance(statistics, dict) or not statistics:
        raise ValueError("statistics: expected a dataset_statistics.json or its dict")
    bad = [k for k, v in statistics.items() if not isinstance(v, dict) or "action" not in v]
    if bad:
        raise ValueError(f"statistics: the entries {bad} have no action statistics")
    check_action_dim(config, statistics)  # against the checkpoint's own norm_stats
    return dataclasses.replace(config, norm_stats=statistics)


def _center_crop(image, scale: float) -> np.ndarray:
    """The evaluation crop of :func:`parallax.data.augment.center_crop` on any image input."""
    if not 0 < scale <= 1:
        raise ValueError(f"center_crop: the area fraction must be in (0, 1], got {scale}")
    if isinstance(image, torch.Tensor) and image.is_floating_point():  # (3, H, W) in [0, 1]
        image = (image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8)
    array = np.asarray(image.cpu() if isinstance(image, torch.Tensor) else image)
    return center_crop(np.ascontiguousarray(array[..., :3]).astype(np.uint8), scale)
