"""LLaVA-NeXT's vision-side pieces: the mlp2x_gelu projector, the layout-free init, and the
checks of the first stage's inputs (image sizes, tile and image-token counts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.init import InitFn
from parallax.tensor import ColumnParallelLinear, RowParallelLinear


class MultiModalProjector(nn.Module):
    """``linear_2(gelu(linear_1(x)))`` (LLaVA's mlp2x_gelu): column- then row-parallel."""

    def __init__(self, vision_dim: int, llm_dim: int, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(ctx=ctx, device=device, dtype=dtype)
        self.linear_1 = ColumnParallelLinear(vision_dim, llm_dim, True, **kw)
        self.linear_2 = RowParallelLinear(llm_dim, llm_dim, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))  # (n, P, h); linear_1 out is (n, P, h/tp)


def llava_init_fn(config: LlavaNextConfig, std: float = 0.02) -> InitFn:
    """LLaVA-NeXT's layout-free init: N(0, std) for matrices and embeddings, zeros for biases,
    ones for norm weights, and ``image_newline`` ~ N(0, 1/h) as LLaVA draws it."""
    newline_std = config.text.hidden_size**-0.5

    def init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if name == "image_newline":
            return torch.empty(shape, device=device).normal_(0.0, newline_std, generator=gen)
        if len(shape) == 1:
            return torch.ones(shape, device=device)
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return init


def image_sizes_list(image_sizes, batch: int) -> list[tuple[int, int] | None]:
    """``(b, 2)`` (height, width) -> one size per sample, ``None`` for ``(0, 0)`` (no image)."""
    sizes = torch.as_tensor(image_sizes).tolist()
    if len(sizes) != batch or any(len(s) != 2 for s in sizes):
        raise ValueError(f"image_sizes must be ({batch}, 2) (height, width), got {sizes}")
    out = []
    for i, (h, w) in enumerate(sizes):
        if (h, w) == (0, 0):
            out.append(None)
        elif h < 1 or w < 1:
            raise ValueError(f"sample {i}: image size {h}x{w} (use 0x0 for no image)")
        else:
            out.append((int(h), int(w)))
    return out


def check_inputs(cfg: LlavaNextConfig, pixel_values, input_ids, sizes) -> None:
    """One ``ValueError`` naming the sample whose tiles or image tokens do not fit its image
    size (a host sync: the image-token counts of ``input_ids`` are read)."""
    b = input_ids.shape[0]
    s = cfg.tile_size
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (b, t), got {tuple(input_ids.shape)}")
    if (
        pixel_values.dim() != 5
        or pixel_values.shape[0] != b
        or tuple(pixel_values.shape[2:]) != (3, s, s)
    ):
        raise ValueError(
            f"pixel_values must be ({b}, max_tiles, 3, {s}, {s}), got {tuple(pixel_values.shape)}"
        )
    given = (input_ids == cfg.image_token_index).sum(1).tolist()
    grid, side = cfg.image_grid_pinpoints, cfg.tile_side
    for i, size in enumerate(sizes):
        need = 0 if size is None else anyres.num_image_tokens(size, grid, s, side)
        tiles = 0 if size is None else anyres.num_tiles(size, grid, s)
        if given[i] != need:
            what = "no image" if size is None else f"an image of {size[0]}x{size[1]}"
            raise ValueError(
                f"sample {i}: {given[i]} image tokens in input_ids, but {what} gives {need}"
            )
        if tiles > pixel_values.shape[1]:
            raise ValueError(
                f"sample {i}: an image of {size[0]}x{size[1]} needs {tiles} tiles, "
                f"pixel_values has {pixel_values.shape[1]}"
            )
