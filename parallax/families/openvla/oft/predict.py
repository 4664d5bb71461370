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
    padded_prompts,
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


def oft_inputs(model, images: list, instructions: list[str], proprio, stats, tokenizer):
    """The first stage's inputs for a batch (``images``: each sample's list of cameras;
    ``proprio``: ``(b, P)`` raw states or ``None``), and the prompt lengths ``(b,)``."""
    oft, config = model.config.oft, model.config
    for i, cameras in enumerate(images):
        if len(cameras) != oft.num_images:
            raise ValueError(
                f"the model takes {oft.num_images} images per sample, sample {i} has {len(cameras)}"
            )
    ids, lengths = zip(
        *(oft_prompt(tokenizer, t, oft.slots, config.pad_token_id) for t in instructions)
    )
    mb = padded_prompts(ids, lengths, oft.slots, config.pad_token_id)
    device = next(model.parameters()).device
    px = torch.stack([oft_pixel_values(cameras, config) for cameras in images])  # (b, 6 n, S, S)
    extra = ()
    if oft.use_proprio:
        if proprio is None:
            raise ValueError("the model has a proprio token: pass the robot state (proprio)")
        state = np.asarray(proprio, dtype=np.float64)  # (b, P)
        if state.shape != (len(images), oft.proprio_dim):
            raise ValueError(
                f"proprio of shape {state.shape} for {len(images)} samples, the model's proprio "
                f"projector takes {oft.proprio_dim} dimensions each"
            )
        if stats is not None:
            state = normalized_proprio(state, stats)
        extra = (torch.tensor(state, dtype=torch.float32),)  # (b, P)
    masks = mb["attention_mask"], mb["action_mask"]
    inputs = (px, mb["input_ids"], *extra, *masks)
    return tuple(x.to(device) for x in inputs), mb["prompt_lengths"]


def _is_image(x) -> bool:
    """One image (an array, tensor or PIL image), not a list of them."""
    if isinstance(x, np.ndarray | torch.Tensor):
        return x.ndim == 3
    return not isinstance(x, list | tuple)


def _cameras(x) -> list:
    """One sample's cameras as a list (one image or a list of them)."""
    return [x] if _is_image(x) else list(x)


def _batch_images(images, b: int) -> list[list]:
    """Each sample's cameras: ``images`` a list of ``b`` samples' images (one or a list each),
    or a batched array/tensor ``(b, ...)`` of one camera per sample or ``(b, n, ...)``."""
    if isinstance(images, np.ndarray | torch.Tensor) and images.ndim not in (4, 5):
        raise ValueError(
            f"batched images must be (b, H, W, 3) / (b, 3, H, W), or (b, n, ...) for n "
            f"cameras; got shape {tuple(images.shape)}"
        )
    if len(images) != b:
        raise ValueError(f"{len(images)} samples of images for {b} instructions")
    return [_cameras(sample) for sample in images]


@torch.no_grad()
def normalized_chunk(model, inputs: tuple, lengths: torch.Tensor) -> torch.Tensor:
    """The normalised chunks ``(b, K, D)`` of a batch, one forward pass (collective over pp
    when split)."""
    config = model.config
    seq = config.prefix_tokens + inputs[1].shape[1]
    rows = head_rows(lengths, seq, config.prefix_tokens, config.oft.slots)  # (b K D,)
    hidden_flag = model.return_hidden
    model.return_hidden = True
    try:
        if model.has_vision and model.has_head:
            hidden = model(*inputs)  # (b, S, h)
            return model.oft_actions(hidden.flatten(0, 1)[rows.to(hidden.device)])
        return _pipelined(model, inputs, rows, seq)
    finally:
        model.return_hidden = hidden_flag


def _pipelined(model, inputs, rows, seq: int) -> torch.Tensor:
    """One forward through the pipeline's stages, the actions broadcast from the last."""
    ctx, config = model.ctx, model.config
    oft, h, b = config.oft, config.text.hidden_size, inputs[1].shape[0]
    schedule = gpipe(ctx.pp_size, 1)
    dtype = next(model.parameters()).dtype
    metas = [TensorMeta((b, seq, h), dtype, False), TensorMeta((b, seq), torch.bool, False)]

    def last(out, m):
        return model.oft_actions(out.flatten(0, 1)[rows.to(out.device)]).float()  # (b, K, D)

    found = run_forward(schedule, {ctx.pp_rank: model}, ctx, [inputs], last, lambda s, m: metas)
    shape = (b, oft.chunk, oft.action_dim)
    actions = found[0] if found else torch.empty(shape, device=ctx.device)
    src = ctx.pp_peer(schedule.rank_of(schedule.num_stages - 1))
    comm.broadcast(actions, src=src, group=ctx.pp_group)
    return actions


def predict_action_chunk(
    model,
    images,
    instruction: str | Sequence[str],
    proprio=None,
    *,
    unnorm_key: str | None = None,
    statistics=None,
    tokenizer=None,
) -> np.ndarray:
    """The next ``K`` actions ``(K, D)`` (float64) of one sample, or ``(b, K, D)`` of a batch,
    de-normalised with the dataset's statistics (``norm_stats[unnorm_key]`` or
    ``statistics``; normalised in [-1, 1] without any), from one forward pass.

    One sample: ``images`` one image or a list of 1 to 3 (primary, then wrist), ``instruction``
    a string, ``proprio`` the robot's raw state ``(P,)`` when the model has a proprio token.
    A batch: ``instruction`` a list of ``b`` strings, ``images`` a list of ``b`` samples' images
    (each as for one sample) or a batched array/tensor ``(b, ...)`` or ``(b, n, ...)`` for ``n``
    cameras, ``proprio`` ``(b, P)``. Images: uint8 ``(H, W, 3)`` arrays or tensors, float
    ``(3, H, W)`` in [0, 1], or PIL images. Prompts of different lengths are right-padded; the
    padding is masked out, so a sample's chunk does not depend on its batch (to fp32
    rounding)."""
    if model.config.oft is None:
        raise ValueError("predict_action_chunk needs an OpenVLA-OFT model (--action-head l1)")
    tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise ValueError("predict_action_chunk needs a tokenizer (install 'tokenizers')")
    single = isinstance(instruction, str)
    instructions = [instruction] if single else list(instruction)
    if not instructions or not all(isinstance(t, str) for t in instructions):
        raise ValueError("instruction: expected a string or a non-empty list of strings")
    if single:
        cameras, states = [_cameras(images)], None if proprio is None else [proprio]
    else:
        cameras, states = _batch_images(images, len(instructions)), proprio
    stats = _statistics(model, unnorm_key, statistics)
    inputs, lengths = oft_inputs(model, cameras, instructions, states, stats, tokenizer)
    normalized = normalized_chunk(model, inputs, lengths).float().cpu().numpy()  # (b, K, D)
    if stats is not None:
        normalized = unnormalize_actions(normalized, stats["action"])
    out = normalized.astype(np.float64)
    return out[0] if single else out
