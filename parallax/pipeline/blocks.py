"""From a list of blocks to this rank's pipeline stages, in one call.

A model written as a sequence of blocks (``nn.Sequential``-like: each block takes the previous
block's output, a tuple being spread over positional arguments) is cut by :func:`split` and only
this rank's chunks are built. Parameters keep the names they have in the whole sequence
(``"7.mlp.weight"`` for block 7), so ``parallax.init_parameters(stage.module, seed)`` gives the
same weights as on the unsplit ``BlockChunk`` of all blocks, at any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import nn

from parallax.context import ParallelContext
from parallax.pipeline.split import split
from parallax.pipeline.stage import PipelineStage


class BlockChunk(nn.Module):
    """Consecutive blocks of a larger model, registered under their global indices."""

    def __init__(self, blocks: Mapping[int, nn.Module] | Sequence[nn.Module]) -> None:
        super().__init__()
        items = blocks.items() if isinstance(blocks, Mapping) else enumerate(blocks)
        for index, block in sorted(items, key=lambda kv: kv[0]):
            self.add_module(str(index), block)

    def forward(self, *args, **kwargs):
        out = None
        for i, block in enumerate(self.children()):
            if i == 0:
                out = block(*args, **kwargs)
            else:
                out = block(*out) if isinstance(out, tuple) else block(out)
        return out


def build_stages(
    blocks: Callable[[int], nn.Module] | Sequence[nn.Module],
    num_blocks: int | None,
    ctx: ParallelContext,
    chunks_per_rank: int = 1,
    costs: Sequence[float] | None = None,
    pin_first: int = 0,
) -> list[PipelineStage]:
    """This rank's :class:`PipelineStage` chunks of a model given as blocks.

    ``blocks`` is a function ``index -> block`` (only this rank's blocks get built) or a
    sequence of blocks. The blocks are split into ``ctx.pp_size * chunks_per_rank`` chunks
    balanced by ``costs`` (default: equal); virtual stage ``s`` lives on pipeline rank
    ``s % pp``, as in :func:`parallax.pipeline.interleaved_1f1b`. Stages are moved to
    ``ctx.device``.
    """
    if not callable(blocks):
        seq = list(blocks)
        num_blocks = len(seq) if num_blocks is None else num_blocks
        blocks = seq.__getitem__
    if num_blocks is None:
        raise ValueError("build_stages: pass num_blocks with a block-building function")
    if costs is not None and len(costs) != num_blocks:
        raise ValueError(f"build_stages: {len(costs)} costs for {num_blocks} blocks")
    costs = [1.0] * num_blocks if costs is None else costs
    ranges = split(costs, ctx.pp_size, chunks_per_rank, pin_first)
    stages = []
    for s, indices in enumerate(ranges):
        if s % ctx.pp_size == ctx.pp_rank:
            chunk = BlockChunk({i: blocks(i) for i in indices}).to(ctx.device)
            stages.append(PipelineStage(chunk, s, len(ranges), ctx))
    return stages
