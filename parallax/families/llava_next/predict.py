"""LLaVA-NeXT inference: greedy decoding with a KV cache, and one-question answers.

The prompt (image tokens included) runs once and fills the cache; each new token costs one
cached decoder step. Under tensor parallelism every tp rank runs this with the same inputs and
the argmax is taken across the vocabulary shards without gathering the logits, so all ranks stop
at the same step.
"""

from __future__ import annotations

import torch

from parallax.models.llama import KVCache
from parallax.tensor.loss import tp_argmax


@torch.no_grad()
def generate(
    model,
    pixel_values: torch.Tensor,
    input_ids: torch.Tensor,
    image_sizes,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Greedy continuation ``(b, n <= max_new_tokens)`` of prompts ``input_ids`` (b, t) of equal
    length (no padding). After a sample's ``eos_id`` it continues with ``eos_id``; decoding
    stops early once every sample has ended."""
    if not (model.has_vision and model.has_head):
        raise ValueError(
            f"generation needs the whole model on this rank (pp=1); it holds {model.block_names[0]}"
            f"..{model.block_names[-1]}"
        )
    lm, vocab = model.language_model, model.config.vocab_size
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    out = []
    if use_cache:
        cache = KVCache()
        first = int(next(iter(lm.model.layers))) if len(lm.model.layers) else 0
        x = lm.forward_layers(model.embed(pixel_values, input_ids, image_sizes), cache)  # (b, t, h)
        logits = lm.head(x[:, -1:])  # (b, 1, V/tp)
    ids = input_ids
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(pixel_values, ids, image_sizes)
        token = tp_argmax(logits[:, -1], model.ctx, vocab)  # (b,)
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        out.append(token)
        if eos_id is not None and bool(done.all()):
            break
        if use_cache:
            x = lm.forward_layers(lm.embed(token[:, None]), cache, start=cache.length(first))
            logits = lm.head(x)  # (b, 1, V/tp)
        else:
            ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(out, dim=1)


def answer(model, processor, image, question: str, max_new_tokens: int = 64, **kwargs) -> str:
    """The model's greedy answer to ``question`` about ``image`` (or ``None``), as text."""
    device = next(model.parameters()).device
    inputs = processor.prompt(image, question, **kwargs)
    tokens = generate(
        model,
        inputs["pixel_values"].to(device),
        inputs["input_ids"].to(device),
        inputs["image_sizes"],
        max_new_tokens,
        eos_id=processor.tokenizer.eos_id,
    )
    return processor.decode(tokens[0].tolist())
