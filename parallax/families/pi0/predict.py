"""pi0 / pi0.5 inference: a chunk of actions by Euler integration of the flow.

Start from ``x = noise`` at ``t = 1`` and take ``N`` steps ``x <- x + dt * v(x, t)`` with
``dt = -1/N`` (t accumulated in float32, as LeRobot does). The prefix (cameras and prompt)
does not depend on ``x`` or ``t``, and it never attends to the suffix, so its keys and values
are computed once (:meth:`~.model.Pi0Model.fill_cache`) and every step runs the expert alone
over them; ``use_cache=False`` recomputes the whole prefix each step (what the cache must equal).
Under tp every rank runs the same call with the same inputs and gets the same chunk; under a
pipeline too, each stage running its own layers (:mod:`.staged`, always over the cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from parallax.families.pi0.batches import normalize, padded, unnormalize
from parallax.families.pi0.checkpoint import load_model
from parallax.families.pi0.prompt import find_tokenizer, padded_ids, prompt_text
from parallax.families.pi0.sampling import sample_chunk


def _batched(images, state):
    """One sample (a list of camera tensors ``(3, S, S)``) or a batch (a list of such lists,
    or a ``(b, n, 3, S, S)`` tensor) -> ``(images (b, n, 3, S, S), state (b, Ds) | None,
    single)``."""
    if isinstance(images, torch.Tensor):
        single = images.dim() == 4
        images = images[None] if single else images
    else:
        single = isinstance(images[0], torch.Tensor)
        rows = [images] if single else images
        images = torch.stack([torch.stack(list(r)) for r in rows])
    if state is not None:
        state = torch.as_tensor(np.asarray(state), dtype=torch.float32)
        state = state[None] if state.dim() == 1 else state
    return images, state, single


def predict_action_chunk(
    model,
    images,
    instruction: str | Sequence[str] | Sequence[Sequence[int]],
    state=None,
    noise: torch.Tensor | None = None,
    *,
    statistics: Mapping | None = None,
    tokenizer=None,
    num_steps: int | None = None,
    image_masks: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The action chunk ``(H, A)`` of one sample, or ``(b, H, A)`` of a batch.

    ``images``: a sample's cameras (a list of ``(3, S, S)`` tensors in [-1, 1], in the model's
    camera order) or a batch of them (``(b, n, 3, S, S)``); ``image_masks`` (b, n): which
    cameras are present (all by default). ``instruction``: the task text (one or a list), or
    token ids in place of text (a list of id lists). ``state`` ``(d,)`` or ``(b, d)``: pi0's
    state token, pi0.5's prompt. ``statistics``: the dataset's ``norm_stats`` entry
    (``action``, ``proprio``): the state is normalised with it and the actions returned
    de-normalised, ``(H, D)`` in the data's units; without it the state is taken as normalised
    and the chunk is returned normalised at the model's padded width. ``tokenizer``: the
    PaliGemma tokenizer (``encode(text) -> ids`` with BOS), else the model folder's own or the
    built-in :class:`~.prompt.ByteTokenizer`. ``noise`` (b, H, A): the flow's start (drawn
    from ``generator`` otherwise)."""
    config = model.config
    device = next(model.parameters()).device
    images, state, single = _batched(images, state)
    b = images.shape[0]
    if statistics is not None and state is not None:
        state = torch.tensor(normalize(state, statistics["proprio"], config.pi05)).float()
    texts = [instruction] if isinstance(instruction, str) else list(instruction)
    if len(texts) != b:
        raise ValueError(f"{b} samples of images but {len(texts)} instructions")
    tokens, token_mask = _prompts(config, texts, state, tokenizer)
    masks = image_masks
    if masks is None:
        masks = torch.ones(b, config.num_cameras, dtype=torch.bool)  # (b, n)
    shape = (b, config.chunk, config.max_action_dim)
    if noise is None:
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    state_in = None
    if not config.pi05 and state is not None:
        state_in = padded(state.numpy(), config.max_state_dim, "a state").to(device)  # (b, Ds)
    prefix = (images, masks, tokens, token_mask)
    out = sample_chunk(
        model, *(x.to(device) for x in prefix), state_in, noise.reshape(shape).to(device), num_steps
    ).cpu()
    if statistics is not None:
        out = torch.from_numpy(unnormalize(out.numpy(), statistics["action"], config.pi05))
    return out[0] if single else out


def _prompts(config, texts, state, tokenizer):
    """``(tokens, token_mask)`` of the instructions (text or ids), pi0.5's with the state."""
    tok = tokenizer or find_tokenizer(None, config.source)
    ids = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            s = None if state is None else state[i].numpy()
            text = tok.encode(prompt_text(text, s, config.pi05))
        ids.append(text)
    return padded_ids(ids, config.text_length, getattr(tok, "pad_id", 0))


def load_policy(path: str | Path, ctx=None, *, dtype=torch.float32, device=None):
    """A pi0 / pi0.5 policy from a LeRobot policy folder (``config.json`` +
    ``model.safetensors``), ready for :func:`predict_action_chunk` (eval mode)."""
    model = load_model(path, ctx, dtype=dtype, device=device)
    return model.eval()
