"""What each pipeline block holds on one tp rank: its parameters by dtype, trainable or frozen,
per optimizer group, and its ZeRO-3 units; counted once per tp on the meta device.

Each block is built alone (:func:`parallax.recipe.adapt.build_chunk` of a one-block range,
shapes only: the recipe's chunk with the run's adapters and freezing, as the Trainer builds
it), so any pipeline split's chunk is a sum of blocks and no layout needs a model of its own:
the planner combines these numbers arithmetically. Element counts are padded as ZeRO's flat
buffers pad them (:func:`parallax.optim.zero.buffers.packing.padded`), and a block's ZeRO-3
units are the ones the optimizer finds (:func:`parallax.optim.zero.weights.units.find_units`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.dims import ParallelDims
from parallax.optim.zero.buffers.packing import padded
from parallax.optim.zero.weights.units import find_units
from parallax.recipe.adapt import build_chunk
from parallax.recipe.flags import option_classes
from parallax.run import Run
from parallax.run import param_groups as groups
from parallax.run.option import options
from parallax.tensor.quant import quantized_weights


@dataclass(frozen=True)
class BlockParams:
    """One block on one tp rank. ``trainable`` and ``frozen`` map an element size (2 or 4
    bytes) to padded elements; ``units`` are the byte sizes of its ZeRO-3 units (a decoder
    layer or ViT block whole, any other module's own parameters apart)."""

    name: str
    params: int  # elements on this tp rank, unpadded (weights held quantized included)
    trainable_params: int
    adapters: int  # LoRA adapter elements
    groups: tuple[int, ...]  # trainable elements per optimizer group (group_labels order)
    trainable: tuple[tuple[int, int], ...]  # (element size, padded elements)
    frozen: tuple[tuple[int, int], ...]
    units: tuple[int, ...]  # bytes of each ZeRO-3 unit, padded
    largest: int  # padded elements of its largest trainable parameter (a bucket holds it whole)
    partial: int = 0  # padded trainable elements whose gradient is partial over tp (own buckets)
    # (padded elements, element size, partial over tp) of each trainable parameter, in order
    sizes: tuple[tuple[int, int, bool], ...] = ()
    # bytes of the frozen weights held quantized (--quantize-base): buffers, not parameters, so
    # whole on every dp rank at any ZeRO stage
    quantized: int = 0
    quantized_params: int = 0  # the elements they stand for

    def trainable_elements(self) -> int:
        return sum(n for _, n in self.trainable)

    def trainable_bytes(self, size: int | None = None) -> int:
        return sum(s * n for s, n in self.trainable if size is None or s == size)

    def frozen_bytes(self) -> int:
        return sum(s * n for s, n in self.frozen)


_CACHE: dict[tuple, tuple[BlockParams, ...]] = {}


def _key(run: Run, tp: int) -> tuple:
    """What the blocks' parameters depend on: the model and the options whose declarations say
    they change its parameters (``params=True``), the family's own among them."""
    values = run.to_dict()
    declared = [f.name for cls in option_classes() for f, o in options(cls) if o.params]
    changing = tuple((n, str(values.get(n))) for n in declared)
    return (run.recipe.name, run.model_name, repr(run.model_config), changing, tp)


def block_params(run, tp: int) -> tuple[BlockParams, ...]:
    """Every block of ``run``'s model at ``tp`` (rank 0 of tp: every tp rank holds as much, to
    the vocabulary's padding); cached per model, adaptation and tp."""
    key = _key(run, tp)
    if key not in _CACHE:
        _CACHE[key] = tuple(_count(run, tp))
    return _CACHE[key]


def _count(run: Run, tp: int) -> list[BlockParams]:
    dtype = torch.bfloat16 if run.precision == "bf16" else torch.float32
    ctx = ParallelContext(dims=ParallelDims(tp=tp), rank=0, device=torch.device("meta"))
    out = []
    for i, block in enumerate(run.recipe.model.blocks(run.model_config)):
        blocks = range(i, i + 1)
        chunk, report = build_chunk(run, blocks, ctx, dtype=dtype, device="meta", checkpoint=None)
        out.append(_block(block.name, chunk, run, report.adapters if report else 0))
    return out


def _block(name: str, chunk: nn.Module, run, adapters: int) -> BlockParams:
    trainable: dict[int, int] = {}
    frozen: dict[int, int] = {}
    for p in chunk.parameters():
        where = trainable if p.requires_grad else frozen
        where[p.element_size()] = where.get(p.element_size(), 0) + padded(p.numel())
    named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
    by_group = tuple(
        sum(p.numel() for _, p in g["params"]) for g in groups.param_groups(named, run)
    )
    held = [q for _, q in quantized_weights(chunk)]  # --quantize-base: buffers, frozen
    return BlockParams(
        name=name,
        params=sum(p.numel() for p in chunk.parameters()) + sum(q.numel() for q in held),
        trainable_params=sum(p.numel() for _, p in named),
        adapters=adapters,
        groups=by_group,
        trainable=tuple(sorted(trainable.items())),
        frozen=tuple(sorted(frozen.items())),
        units=tuple(unit_bytes(chunk)),
        largest=max((padded(p.numel()) for _, p in named), default=0),
        partial=sum(padded(p.numel()) for _, p in named if _partial(p)),
        sizes=tuple((padded(p.numel()), p.element_size(), _partial(p)) for _, p in named),
        quantized=sum(q.nbytes() for q in held),
        quantized_params=sum(q.numel() for q in held),
    )


def _partial(p: torch.Tensor) -> bool:
    return bool(getattr(p, "sequence_parallel", False))


def unit_bytes(chunk: nn.Module) -> list[int]:
    """Bytes of each ZeRO-3 unit of ``chunk``, padded, as the optimizer finds the units."""
    return [
        sum(padded(p.numel()) * p.element_size() for p in u.params) for u in find_units([chunk])
    ]
