"""The LLaVA-NeXT benchmark's workload and shared weights, the same for every row.

Workload: a realistic image mix (``IMAGE_MIX``: mostly 640x480 and 1024x768 photos, some square,
wide and small ones; 2,302 image tokens per sample on average for LLaVA-v1.6's pinpoints) with
60-140 text tokens per sample (a question before and after the image tokens, then the answer:
the last 20-60 tokens and EOS are supervised). Images are random pixels; the model computes the
same whatever they show. The global batch is grouped by length (sorted, then cut into
microbatches of neighbours, as the trainer's :class:`~parallax.data.LengthGroupedLoader` does),
and every row takes the same microbatches.

Weights: parallax's layout-free init of ``--seed`` rounded to bf16 (so a bf16 forward of the
fp32 masters is the same in every row), handed to the natives and Hugging Face under the
llava-hf names (:class:`parallax.families.llava_next.checkpoint.CheckpointLayout`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from parallax.families.llava_next import anyres
from parallax.families.llava_next.checkpoint import LLAVA_HF, CheckpointLayout
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.flops import sample_flops
from parallax.families.llava_next.model import LlavaNext

# (height, width) and weight: 2,302 image tokens per sample on average
IMAGE_MIX = (
    ((480, 640), 0.40),  # 640x480 landscape: 5 tiles, 2,340 tokens
    ((768, 1024), 0.30),  # 1024x768: 5 tiles, 2,340 tokens
    ((640, 480), 0.10),  # portrait: 5 tiles, 2,352 tokens
    ((672, 672), 0.08),  # square: 5 tiles, 2,928 tokens
    ((1080, 1920), 0.07),  # 16:9: 5 tiles, 1,948 tokens
    ((336, 336), 0.05),  # small: 3 tiles, 1,176 tokens
)


def samples(config: LlavaNextConfig, n: int, seed: int = 0) -> list[dict]:
    """``n`` sample plans: image size, tiles, image tokens, text before/after and answer."""
    rng = np.random.default_rng(seed)
    sizes, weights = zip(*IMAGE_MIX)
    out = []
    for _ in range(n):
        size = sizes[int(rng.choice(len(sizes), p=np.asarray(weights) / sum(weights)))]
        grid, tile = config.image_grid_pinpoints, config.tile_size
        answer = int(rng.integers(20, 61))
        prompt = int(rng.integers(40, 81))
        out.append(
            {
                "size": size,
                "tiles": anyres.num_tiles(size, grid, tile),
                "image_tokens": anyres.num_image_tokens(size, grid, tile, config.tile_side),
                "before": 1 + prompt // 3,  # BOS and the system text
                "after": prompt - prompt // 3,
                "answer": answer,
            }
        )
    return out


def _ids(plan: dict, config: LlavaNextConfig, g: torch.Generator) -> tuple[list, list]:
    text_vocab = min(config.image_token_index, config.vocab_size) - 3
    n = plan["before"] + plan["after"] + plan["answer"]
    text = (torch.randint(0, text_vocab, (n,), generator=g) + 3).tolist()
    b, a = plan["before"], plan["after"]
    ids = [1] + text[: b - 1] + [config.image_token_index] * plan["image_tokens"]
    ids += text[b - 1 : b + a] + text[b + a :] + [2]
    labels = [-100] * (len(ids) - plan["answer"] - 1) + ids[-plan["answer"] - 1 :]
    return ids, labels


def microbatches(
    config: LlavaNextConfig, plans: list[dict], micro: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """The global batch of ``plans`` sorted by length and cut into microbatches of ``micro``
    (right-padded, the processor's layout, with ``lengths`` and ``num_tiles``)."""
    g = torch.Generator().manual_seed(seed)
    encoded = []
    for plan in plans:
        ids, labels = _ids(plan, config, g)
        encoded.append((plan, ids, labels))
    encoded.sort(key=lambda e: len(e[1]))
    s = config.tile_size
    out = []
    for k in range(0, len(encoded), micro):
        part = encoded[k : k + micro]
        b, t = len(part), max(len(e[1]) for e in part)
        tiles = max(e[0]["tiles"] for e in part)
        mb = {
            "pixel_values": torch.zeros(b, tiles, 3, s, s),
            "image_sizes": torch.zeros(b, 2, dtype=torch.long),
            "input_ids": torch.full((b, t), config.pad_token_id, dtype=torch.long),
            "labels": torch.full((b, t), -100, dtype=torch.long),
            "lengths": torch.tensor([len(e[1]) for e in part]),
            "num_tiles": torch.tensor([e[0]["tiles"] for e in part]),
        }
        for i, (plan, ids, labels) in enumerate(part):
            n = plan["tiles"]
            mb["pixel_values"][i, :n] = torch.randn(n, 3, s, s, generator=g)
            mb["image_sizes"][i] = torch.tensor(plan["size"])
            mb["input_ids"][i, : len(ids)] = torch.tensor(ids)
            mb["labels"][i, : len(labels)] = torch.tensor(labels)
        out.append(mb)
    return out


def padding_fraction(mbs: list[dict]) -> float:
    """Share of the language model's token positions that are padding."""
    real = sum(int(mb["lengths"].sum()) for mb in mbs)
    run = sum(mb["input_ids"].numel() for mb in mbs)
    return 1.0 - real / run


def step_flops(config: LlavaNextConfig, mbs: list[dict], *, labelled_logits: bool) -> float:
    """Model FLOPs of one step (:mod:`parallax.families.llava_next.flops`, padding not counted)."""
    total = 0.0
    for mb in mbs:
        rows = (mb["labels"][:, 1:] != -100).sum(1).tolist()
        for i, (n, tiles) in enumerate(zip(mb["lengths"].tolist(), mb["num_tiles"].tolist())):
            total += sample_flops(
                config, tiles, n, logits_rows=rows[i] if labelled_logits else None
            )
    return total


def shared_init(model: LlavaNext, seed: int) -> None:
    """The rows' common start: parallax's init of ``seed``, rounded to bf16."""
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def hf_state_dict(config: LlavaNextConfig, seed: int, device) -> Iterator[tuple[str, torch.Tensor]]:
    """``(llava-hf name, fp32 tensor)`` of :func:`shared_init`, one parameter at a time (the
    unused last CLIP layer and ``post_layernorm`` not included)."""
    model = LlavaNext(config, None, dtype=torch.float32, device=device)
    shared_init(model, seed)
    layout = CheckpointLayout(config, LLAVA_HF)
    for name, p in model.named_parameters():
        parts = layout.tensors(name, tuple(p.shape))
        values = p.detach().split(parts[0][1][0], dim=0) if len(parts) > 1 else [p.detach()]
        for (hf_name, shape), value in zip(parts, values):
            yield hf_name, value.reshape(shape)
