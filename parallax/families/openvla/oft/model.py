"""The first stage of an OpenVLA-OFT model: images, prompt, proprio and empty action slots ->
the hidden states and the key mask the bidirectional layers take (``config`` has the
sequence's layout).

As OFT's ``PrismaticForConditionalGeneration.forward``: the token embeddings at the action
slots are multiplied by zero; with FiLM, the towers are conditioned on the mean of the token
embeddings that are not action slots (BOS, the prompt and the stop token); the patches of
every image and then the proprio token go right after BOS; the key mask is the text's
attention mask with the inserted tokens kept.

One difference, on purpose: OFT averages ``input_embeddings[~all_actions_mask]``, which in a
right-padded training batch includes the padding's embeddings, so its FiLM input depends on
the batch's longest prompt and differs between training and inference (a batch of one has no
padding). Here the padding is left out of the mean as it is out of attention: a sample's
forward is the same in any batch, and the same in training and in ``predict_action_chunk``.
"""

from __future__ import annotations

import torch

from parallax.tensor.layers import weight_dtype


def oft_embed(model, pixel_values: torch.Tensor, input_ids: torch.Tensor, *rest: torch.Tensor):
    """``(x (b, prefix + t, h), key_mask (b, prefix + t) bool)`` from ``pixel_values``
    ``(b, 6 n, S, S)``, ``input_ids`` ``(b, t)``, then ``proprio`` ``(b, proprio_dim)`` when
    the model has a proprio token, ``attention_mask`` and ``action_mask`` ``(b, t)`` bool."""
    oft = model.config.oft
    want = 3 if oft.use_proprio else 2
    if len(rest) != want:
        raise ValueError(f"an OFT model's first stage takes ({', '.join(model.first_inputs)})")
    proprio = rest[0] if oft.use_proprio else None
    attention_mask, action_mask = (m.bool() for m in rest[-2:])
    model.check_inputs(pixel_values, input_ids)
    b, t = input_ids.shape
    for name, m in (("attention_mask", attention_mask), ("action_mask", action_mask)):
        if tuple(m.shape) != (b, t):
            raise ValueError(f"{name} must be (b, t) = {(b, t)}, got {tuple(m.shape)}")
    dtype = weight_dtype(model.projector.fc1)
    tokens = model.language_model.embed(input_ids)  # (b, t, h)
    keep = (~action_mask).to(tokens.dtype)[..., None]  # (b, t, 1)
    film = None
    if oft.film:  # the mean language embedding of each sample (no slots, no padding)
        text = (~action_mask & attention_mask).to(tokens.dtype)[..., None]  # (b, t, 1)
        film = (tokens * text).sum(1) / text.sum(1).clamp(min=1)  # (b, h)
    patches = model.projector(model.vision_backbone(pixel_values.to(dtype), film))  # (b, nP, h)
    if proprio is not None:
        token = model.proprio_projector(proprio.to(dtype))[:, None]  # (b, 1, h)
        patches = torch.cat([patches, token], dim=1)  # (b, prefix, h)
    tokens = tokens * keep  # empty action slots: zero embeddings
    x = torch.cat([tokens[:, :1], patches, tokens[:, 1:]], dim=1)  # (b, prefix + t, h)
    inserted = torch.ones(b, patches.shape[1], dtype=torch.bool, device=x.device)
    key_mask = torch.cat([attention_mask[:, :1], inserted, attention_mask[:, 1:]], dim=1)
    return x, key_mask  # (b, s, h), (b, s)
