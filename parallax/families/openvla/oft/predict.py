"""OpenVLA-OFT inference: a whole chunk of continuous actions from one forward pass.

As OFT's ``predict_action``: the prompt ``In: What action should the robot take to
{instruction}?\\nOut: ▁`` is followed by ``K x D`` empty action slots and the stop token,
attention is bidirectional, no KV cache is kept, and the L1 head reads the final-norm hidden
states one position before each slot. The same sequence as in training
(:func:`~.batches.oft_prompt`), so the forward is the training forward at the same
positions. Under tensor parallelism every tp rank runs it with the same inputs; under a
pipeline every rank calls it (collective), each stage runs its blocks, and the last one's
actions reach every pipeline rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from parallax import comm
from parallax.families.openvla.action_tokenizer import unnormalize_actions
from parallax.families.openvla.oft.batches import (
    normalized_proprio,
    oft_pixel_values,
    oft_prompt,
)
from parallax.families.openvla.oft.config import head_rows
from parallax.families.openvla.predict import config_with_statistics
from parallax.pipeline import TensorMeta, gpipe
from parallax.pipeline.forward import run_forward


def _statistics(model, unnorm_key: str | None, statistics) -> dict | None:
    """The entry of ``norm_stats`` (or of ``statistics``: a dataset_statistics.json path or
    dict) the actions and the state are normalised with; ``None`` when there are none."""
    config = model.config
    if statistics is not None:
        config = config_with_statistics(config, statistics)
    if not config.norm_stats:
        return None
    config.action_stats(unnorm_key)  # checks the key
    key = unnorm_key or next(iter(config.norm_stats))
    return config.norm_stats[key]


def oft_inputs(model, images, instruction: str, proprio, stats, tokenizer):
    """The first stage's inputs for one sample, and its prompt length."""
    oft, config = model.config.oft, model.config
    images = list(images) if isinstance(images, Sequence) and not _is_image(images) else [images]
    if len(images) != oft.num_images:
        raise ValueError(f"the model takes {oft.num_images} images, got {len(images)}")
    ids, length = oft_prompt(tokenizer, instruction, oft.slots, config.pad_token_id)
    device = next(model.parameters()).device
    px = oft_pixel_values(images, config)[None].to(device)  # (1, 6 n, S, S)
    ids_t = torch.tensor([ids], dtype=torch.long, device=device)  # (1, t)
    attention = torch.ones_like(ids_t, dtype=torch.bool)
    slots = torch.zeros_like(attention)
    slots[0, length : length + oft.slots] = True
    extra = ()
    if oft.use_proprio:
        if proprio is None:
            raise ValueError("the model has a proprio token: pass the robot state (proprio)")
        if stats is not None:
            state = normalized_proprio(proprio, stats)
        else:
            state = np.asarray(proprio, dtype=np.float64)
        extra = (torch.tensor(state, dtype=torch.float32, device=device)[None],)  # (1, P)
    return (px, ids_t, *extra, attention, slots), length


def _is_image(x) -> bool:
    """One image (an array, tensor or PIL image), not a list of them."""
    if isinstance(x, np.ndarray | torch.Tensor):
        return x.ndim == 3
    return not isinstance(x, list | tuple)


@torch.no_grad()
def normalized_chunk(model, inputs: tuple, length: int) -> torch.Tensor:
    """The normalised chunk ``(K, D)`` of one sample (collective over pp when split)."""
    config = model.config
    seq = config.prefix_tokens + inputs[1].shape[1]
    rows = head_rows(torch.tensor([length]), seq, config.prefix_tokens, config.oft.slots)
    hidden_flag = model.return_hidden
    model.return_hidden = True
    try:
        if model.has_vision and model.has_head:
            hidden = model(*inputs)  # (1, S, h)
            return model.oft_actions(hidden.flatten(0, 1)[rows.to(hidden.device)])[0]
        return _pipelined(model, inputs, rows, seq)
    finally:
        model.return_hidden = hidden_flag


def _pipelined(model, inputs, rows, seq: int) -> torch.Tensor:
    """One forward through the pipeline's stages, the actions broadcast from the last."""
    ctx, config = model.ctx, model.config
    oft, h = config.oft, config.text.hidden_size
    schedule = gpipe(ctx.pp_size, 1)
    dtype = next(model.parameters()).dtype
    metas = [TensorMeta((1, seq, h), dtype, False), TensorMeta((1, seq), torch.bool, False)]

    def last(out, m):
        return model.oft_actions(out.flatten(0, 1)[rows.to(out.device)])[0].float()

    found = run_forward(schedule, {ctx.pp_rank: model}, ctx, [inputs], last, lambda s, m: metas)
    actions = found[0] if found else torch.empty(oft.chunk, oft.action_dim, device=ctx.device)
    src = ctx.pp_peer(schedule.rank_of(schedule.num_stages - 1))
    comm.broadcast(actions, src=src, group=ctx.pp_group)
    return actions


def predict_action_chunk(
    model,
    images,
    instruction: str,
    proprio=None,
    *,
    unnorm_key: str | None = None,
    statistics=None,
    tokenizer=None,
) -> np.ndarray:
    """The next ``K`` actions ``(K, D)`` (float64), de-normalised with the dataset's
    statistics (``norm_stats[unnorm_key]`` or ``statistics``; normalised in [-1, 1] without
    any), from the model's cameras (one image or a list of 1 to 3: primary, then wrist) and,
    with a proprio token, the robot's raw state. ``images``: uint8 ``(H, W, 3)`` arrays or
    tensors, float ``(3, H, W)`` in [0, 1], or PIL images."""
    if model.config.oft is None:
        raise ValueError("predict_action_chunk needs an OpenVLA-OFT model (--action-head l1)")
    tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise ValueError("predict_action_chunk needs a tokenizer (install 'tokenizers')")
    stats = _statistics(model, unnorm_key, statistics)
    inputs, length = oft_inputs(model, images, instruction, proprio, stats, tokenizer)
    normalized = normalized_chunk(model, inputs, length).float().cpu().numpy()
    if stats is None:
        return normalized.astype(np.float64)
    return unnormalize_actions(normalized, stats["action"])
