"""Where every trainable parameter lives in the flat buffers, and which part each dp rank owns.

Pure arithmetic, no tensors and no processes: every dp rank computes the same layout from the
same parameter shapes, which is what lets them make identical collectives in an identical order,
and the planner (:mod:`parallax.plan.memory`) packs its counts of a model with the same code
(:func:`bucket_numels`) instead of a copy of these rules.

Parameters are packed into one flat buffer per dtype, in reverse order (the order in which the
backward pass tends to finish them), and the buffer is cut into buckets of about
``bucket_numel`` elements. A parameter never straddles two buckets. Each bucket is padded to a
multiple of ``dp * ALIGN`` elements and split into ``dp`` equal chunks: dp rank ``r`` owns chunk
``r`` of every bucket, so one reduce-scatter and one all-gather per bucket move exactly the
owned parts, and the slices are balanced to within the padding. Parameters whose gradient is
partial over tp (``sequence_parallel``) get buckets of their own, reduced last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: every parameter and every chunk starts on a 32/64-byte boundary
DEFAULT_BUCKET_NUMEL = 25_000_000  # 50 MB of bf16 gradients per reduce-scatter
# a dtype per element size, for counts that have sizes only (the planner's): the packing keys a
# flat buffer by dtype, and these are the model dtypes of those sizes
SIZE_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def padded(numel: int, multiple: int = ALIGN) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (a parameter's slot: ``ALIGN``)."""
    return -(-numel // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    """One parameter's place: ``buffer[offset : offset + numel]`` of flat buffer ``buffer``."""

    buffer: int
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A padded range ``[start, end)`` of one flat buffer, reduced and gathered as one message."""

    index: int  # position in the launch order
    buffer: int
    start: int
    end: int
    params: tuple[int, ...]
    sequence_parallel: bool
    dp: int
    unit: int = 0  # the group of parameters it belongs to (a block at ZeRO-3, a chunk at 2)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk(self) -> int:
        """Elements owned by each dp rank."""
        return self.numel // self.dp

    def chunk_start(self, dp_rank: int) -> int:
        """Start of dp rank ``dp_rank``'s chunk in the flat buffer."""
        return self.start + dp_rank * self.chunk


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` (flattened, ``[start, start + numel)``) that a rank owns;
    it sits at ``chunk_offset`` inside that rank's chunk of bucket ``bucket``."""

    param: int
    start: int
    numel: int
    bucket: int
    chunk_offset: int


@dataclass(frozen=True)
class FlatLayout:
    dtypes: tuple[torch.dtype, ...]  # flat buffer i holds parameters of dtypes[i]
    sizes: tuple[int, ...]  # elements of flat buffer i, padding included
    slots: tuple[Slot, ...]  # per parameter, in the optimizer's parameter order
    buckets: tuple[Bucket, ...]  # in launch order: every rank reduces them in this order
    dp: int

    def pieces(self, dp_rank: int) -> list[Piece]:
        """What dp rank ``dp_rank`` owns, bucket by bucket (padding is owned by nobody)."""
        out = []
        for bucket in self.buckets:
            lo = bucket.chunk_start(dp_rank)
            hi = lo + bucket.chunk
            for i in bucket.params:
                slot = self.slots[i]
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    out.append(Piece(i, a - slot.offset, b - a, bucket.index, a - lo))
        return out


class _Packer:
    """Buckets being filled, one open bucket per (buffer, sequence-parallel) key."""

    def __init__(self, shapes, dtypes, sequence_parallel, dp: int, bucket_numel: int) -> None:
        self.shapes, self.dtypes, self.sp = shapes, dtypes, sequence_parallel
        self.dp, self.bucket_numel = dp, bucket_numel
        self.buffer_dtypes = tuple(dict.fromkeys(dtypes))  # first-seen order
        self.sizes = [0] * len(self.buffer_dtypes)
        self.slots: dict[int, Slot] = {}
        self.buckets: list[Bucket] = []
        self.open: dict[tuple[int, bool], list[int]] = {}  # key -> params of the open bucket
        self.filled: dict[tuple[int, bool], int] = {}  # key -> elements in the open bucket
        self.unit = 0

    def close(self, key: tuple[int, bool]) -> None:
        members = self.open.pop(key, [])
        self.filled.pop(key, None)
        if not members:
            return
        buf, sp = key
        start = offset = self.sizes[buf]
        for i in members:
            numel = _numel(self.shapes[i])
            self.slots[i] = Slot(buf, offset, numel, len(self.buckets))
            offset += padded(numel, ALIGN)
        end = start + padded(offset - start, self.dp * ALIGN)
        self.sizes[buf] = end
        index = len(self.buckets)
        self.buckets.append(
            Bucket(index, buf, start, end, tuple(members), sp, self.dp, unit=self.unit)
        )

    def fill(self, i: int) -> None:
        key = (self.buffer_dtypes.index(self.dtypes[i]), bool(self.sp[i]))
        self.open.setdefault(key, []).append(i)
        self.filled[key] = self.filled.get(key, 0) + padded(_numel(self.shapes[i]), ALIGN)
        if self.filled[key] >= self.bucket_numel:
            self.close(key)

    def close_all(self, sequence_parallel: bool | None = None) -> None:
        """Close the open buckets (only those of one kind when ``sequence_parallel`` is given)."""
        for key in sorted(self.open):
            if sequence_parallel is None or key[1] == sequence_parallel:
                self.close(key)

    def layout(self) -> FlatLayout:
        slots = tuple(self.slots[i] for i in range(len(self.shapes)))
        return FlatLayout(
            self.buffer_dtypes, tuple(self.sizes), slots, tuple(self.buckets), self.dp
        )


def build_layout(
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    sequence_parallel: Sequence[bool],
    dp: int,
    bucket_numel: int,
    order: Sequence[int] | None = None,
    units: Sequence[int] | None = None,
) -> FlatLayout:
    """Pack parameters (given by shape, dtype and sequence-parallel flag) into buckets.

    ``order`` lists the parameter indices in the order the forward pass uses them (default:
    as given); they are packed and reduced from its end. ``units`` (a unit per parameter, each
    unit's parameters contiguous in ``order``): no bucket holds two units, and each unit's
    sequence-parallel buckets follow its others (ZeRO-2 and 3 reduce unit by unit).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    order = list(range(len(shapes)) if order is None else order)[::-1]  # backward: last first
    if sorted(order) != list(range(len(shapes))):
        raise ValueError("order must be a permutation of the parameter indices")
    packer = _Packer(shapes, dtypes, sequence_parallel, dp, bucket_numel)
    for unit, members in _unit_runs(order, units):
        packer.unit = unit
        for i in members:
            if not sequence_parallel[i]:
                packer.fill(i)
        packer.close_all(sequence_parallel=False)
        for i in members:  # partial-over-tp gradients: their own buckets, reduced last
            if sequence_parallel[i]:
                packer.fill(i)
        packer.close_all()
    return packer.layout()


def _unit_runs(order: list[int], units: Sequence[int] | None) -> list[tuple[int, list[int]]]:
    """``order`` cut where the unit changes; every unit must be one run."""
    if units is None:
        return [(0, order)]
    runs: list[tuple[int, list[int]]] = []
    for i in order:
        if runs and runs[-1][0] == units[i]:
            runs[-1][1].append(i)
        else:
            runs.append((units[i], [i]))
    if len({u for u, _ in runs}) != len(runs):
        raise ValueError("each unit's parameters must be contiguous in the order")
    return runs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def bucket_numels(
    params: Sequence[tuple[int, int, bool]], dp: int = 1, bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> list[tuple[tuple[int, bool], int]]:
    """``((element size, partial over tp), elements)`` of each bucket :func:`build_layout` makes
    of ``params`` (``(numel, element size, partial over tp)`` each, in forward order), in launch
    order: the packing for counts without tensors (the planner's)."""
    try:
        dtypes = [SIZE_DTYPES[size] for _, size, _ in params]
    except KeyError as err:
        raise ValueError(f"no model dtype has elements of {err.args[0]} bytes") from None
    shapes = [(n,) for n, _, _ in params]
    layout = build_layout(shapes, dtypes, [partial for *_, partial in params], dp, bucket_numel)
    return [
        ((layout.dtypes[b.buffer].itemsize, b.sequence_parallel), b.numel) for b in layout.buckets
    ]
