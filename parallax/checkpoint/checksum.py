"""CRC-32 checksums of checkpoint tensors in tiles, so a rank that reads a slice checks only that.

A tensor of shape ``(d0, d1, ...)`` is viewed as a matrix of ``d0`` rows and ``d1 * d2 * ...``
columns (a scalar as 1 x 1, a vector as ``d0`` x 1) and cut into tiles of ``rows x cols``
elements: ``cols`` at most :attr:`Chunking.columns`, ``rows`` as many as keep a tile near
:attr:`Chunking.bytes`. Each tile's CRC-32 (``zlib.crc32`` of its bytes, row by row) goes into
``index.json`` next to the tensor's dtype and shape: ``"chunks": [rows, cols]`` and
``"crc32": [...]``, one per tile, row-major over the tile grid.

Why tiles: a tp slice along dim 0 is a block of rows of that matrix, one along dim 1 a block of
its columns; either overlaps only some tiles, so a rank verifying its slice hashes about the
bytes it reads (at most one partial tile more at each edge), not the whole tensor. A slice
along a later dim is verified conservatively: every column between its first and last element.
CRC-32 catches random damage (flipped bits, overwritten or zeroed blocks), not tampering.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

Index = int | slice | tuple[int | slice, ...]


@dataclass(frozen=True)
class Chunking:
    """How a writer cuts tensors into checksummed tiles (readers take it from the index)."""

    bytes: int = 4 << 20  # target bytes per tile: large enough that hashing is streaming-fast
    columns: int = 256  # at most this many columns per tile: a column slice reads few extra

    def geometry(self, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
        """``(rows, cols)`` of one tile of a tensor of ``shape``."""
        n_rows, n_cols = matrix_shape(shape)
        cols = max(1, min(n_cols, self.columns))
        rows = max(1, min(n_rows, self.bytes // (cols * itemsize)))
        return rows, cols


DEFAULT_CHUNKING = Chunking()


def matrix_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """The (rows, columns) a tensor is viewed as for tiling."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def tile_count(shape: tuple[int, ...] | list[int], rows: int, cols: int) -> int:
    n_rows, n_cols = matrix_shape(shape)
    if n_rows * n_cols == 0:
        return 0
    return math.ceil(n_rows / rows) * math.ceil(n_cols / cols)


def tile_bounds(
    shape: tuple[int, ...] | list[int], rows: int, cols: int, k: int
) -> tuple[int, int, int, int]:
    """Tile ``k``'s rows ``r0:r1`` and columns ``c0:c1`` (in elements)."""
    n_rows, n_cols = matrix_shape(shape)
    per_row = math.ceil(n_cols / cols)
    i, j = divmod(k, per_row)
    return i * rows, min(n_rows, (i + 1) * rows), j * cols, min(n_cols, (j + 1) * cols)


def tile_bytes(matrix: np.ndarray, bounds: tuple[int, int, int, int], itemsize: int) -> bytes:
    """One tile of ``matrix`` (a tensor's bytes as ``(rows, cols * itemsize)`` uint8)."""
    r0, r1, c0, c1 = bounds
    return np.ascontiguousarray(matrix[r0:r1, c0 * itemsize : c1 * itemsize]).data


def checksums(matrix: np.ndarray, shape: tuple[int, ...], itemsize: int, rows: int, cols: int):
    """The CRC-32 of every tile of a tensor whose bytes are ``matrix`` (see :func:`as_matrix`)."""
    return [
        zlib.crc32(tile_bytes(matrix, tile_bounds(shape, rows, cols, k), itemsize))
        for k in range(tile_count(shape, rows, cols))
    ]


def as_matrix(data: np.ndarray, shape: tuple[int, ...] | list[int], itemsize: int) -> np.ndarray:
    """A tensor's flat uint8 bytes viewed as its tiling matrix ``(rows, cols * itemsize)``."""
    n_rows, n_cols = matrix_shape(shape)
    return data.reshape(n_rows, n_cols * itemsize)


def _ranges(shape: tuple[int, ...], index: Index | None) -> list[tuple[int, int]] | None:
    """Per-dim ``[start, stop)`` of the elements ``tensor[index]`` selects (conservative for
    steps), or ``None`` for an index this does not understand (then: the whole tensor)."""
    items = () if index is None else index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        return None
    out = []
    for dim, size in enumerate(shape):
        item = items[dim] if dim < len(items) else slice(None)
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step < 0:
                return None
            stop = start if stop <= start else start + (stop - start - 1) // step * step + 1
        elif isinstance(item, int):
            start = item % size if -size <= item < size else 0
            stop = start + 1 if -size <= item < size else 0
        else:
            return None
        out.append((start, stop))
    return out


def tiles_touched(
    shape: tuple[int, ...] | list[int], index: Index | None, rows: int, cols: int
) -> list[int]:
    """The tiles that hold an element of ``tensor[index]`` (basic indexing: ints and slices)."""
    shape = tuple(int(d) for d in shape)
    total = tile_count(shape, rows, cols)
    ranges = _ranges(shape, index) if shape else [(0, 1)]
    if ranges is None:
        return list(range(total))
    if any(stop <= start for start, stop in ranges) or total == 0:
        return []
    (r0, r1), rest = ranges[0], ranges[1:]
    strides = [math.prod(shape[d + 1 :]) for d in range(1, len(shape))]
    c0 = sum(s * st for (s, _), st in zip(rest, strides))
    c1 = sum((e - 1) * st for (_, e), st in zip(rest, strides)) + 1
    per_row = math.ceil(matrix_shape(shape)[1] / cols)
    return [
        i * per_row + j
        for i in range(r0 // rows, (r1 - 1) // rows + 1)
        for j in range(c0 // cols, (c1 - 1) // cols + 1)
    ]
