"""AnyRes, as transformers' LLaVA-NeXT computes it: canvas choice, tiles, unpadding, token count.

An image of (height, width) is fitted into the grid pinpoint that keeps the most of its pixels
(ties: the least wasted canvas), resized keeping its aspect ratio (the short side rounded up),
centred on a black canvas and cut into ``tile`` squares, row-major; a squashed copy of the whole
image goes first as the base tile. After the vision tower and projector, the grid tiles' features
are stitched into one feature map of ``(gh * side, gw * side)`` positions, the rows (or columns)
that only saw the black padding are cropped, an ``image_newline`` column is appended to every row,
and the map is flattened row-major after the base tile's ``side**2`` features.

Every size here is (height, width), the transformers convention. The original LLaVA code takes
(width, height), and its unpadding computes the kept extent as ``int(size * scale)`` where
transformers uses ``int(round(size * scale, 7))``: the two can differ by one row when the product
lands a hair below an integer. This module follows transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Size = tuple[int, int]


def select_best_resolution(image_size: Size, pinpoints: Sequence[Size]) -> Size:
    """The pinpoint (height, width) that shows the most of the image's pixels after an
    aspect-preserving fit; ties go to the one that wastes the least canvas."""
    h, w = image_size
    best, best_effective, best_waste = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        waste = ph * pw - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (ph, pw), effective, waste
    return best


def resized_size(image_size: Size, canvas: Size) -> Size:
    """(height, width) of the image fitted into ``canvas`` keeping its aspect ratio: the side that
    fills the canvas exactly, the other rounded up (and never past the canvas)."""
    h, w = image_size
    ch, cw = canvas
    scale_w, scale_h = cw / w, ch / h  # products taken as transformers takes them
    if scale_w < scale_h:
        return min(math.ceil(h * scale_w), ch), cw
    return ch, min(math.ceil(w * scale_h), cw)


def grid_shape(image_size: Size, pinpoints: Sequence[Size], tile: int) -> Size:
    """Tiles (rows, columns) of the canvas chosen for ``image_size``."""
    ch, cw = select_best_resolution(image_size, pinpoints)
    return ch // tile, cw // tile


def num_tiles(image_size: Size, pinpoints: Sequence[Size], tile: int) -> int:
    """Vision-tower passes for one image: the grid tiles plus the base image."""
    gh, gw = grid_shape(image_size, pinpoints, tile)
    return 1 + gh * gw


def unpad_bounds(image_size: Size, rows: int, cols: int) -> tuple[int, int, int, int]:
    """``(row_start, row_stop, col_start, col_stop)`` of the feature map ``rows x cols`` that
    covers the image rather than the canvas padding (transformers' rounding, see module doc)."""
    h, w = image_size
    if w / h > cols / rows:  # wider than the canvas: padding above and below
        kept = int(round(h * (cols / w), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(w * (rows / h), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def num_image_tokens(image_size: Size, pinpoints: Sequence[Size], tile: int, side: int) -> int:
    """Image tokens one image puts into the sequence: ``side**2`` base features plus
    ``rows x (cols + 1)`` for the unpadded map and its newline column."""
    gh, gw = grid_shape(image_size, pinpoints, tile)
    r0, r1, c0, c1 = unpad_bounds(image_size, gh * side, gw * side)
    return side * side + (r1 - r0) * (c1 - c0 + 1)


def pack_image(
    features: torch.Tensor,
    image_size: Size,
    pinpoints: Sequence[Size],
    tile: int,
    newline: torch.Tensor,
) -> torch.Tensor:
    """One image's projected tile features ``(1 + gh * gw, side**2, h)`` (base tile first) ->
    its sequence of image tokens ``(n, h)``."""
    n, p, hidden = features.shape
    side = math.isqrt(p)
    gh, gw = grid_shape(image_size, pinpoints, tile)
    if n != 1 + gh * gw or side * side != p:
        raise ValueError(
            f"an image of {image_size[0]}x{image_size[1]} needs {1 + gh * gw} tiles of "
            f"{side * side} features, got {n} of {p}"
        )
    grid = features[1:].view(gh, gw, side, side, hidden).permute(0, 2, 1, 3, 4)
    grid = grid.reshape(gh * side, gw * side, hidden)  # (rows, cols, h): one feature map
    r0, r1, c0, c1 = unpad_bounds(image_size, gh * side, gw * side)
    grid = grid[r0:r1, c0:c1]  # (rows', cols', h)
    column = newline.to(grid.dtype).expand(grid.shape[0], 1, hidden)  # (rows', 1, h)
    grid = torch.cat([grid, column], dim=1).reshape(-1, hidden)  # (rows' * (cols' + 1), h)
    return torch.cat([features[0], grid], dim=0)  # (side**2 + rows' * (cols' + 1), h)
