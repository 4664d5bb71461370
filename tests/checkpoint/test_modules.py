"""A model saved at tp 2 loads at tp 1 and at tp 2 with exactly the same logical weights."""

import pytest
import torch
from torch import nn

from parallax import init_parameters
from parallax.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_module,
    module_sources,
    save_checkpoint,
)
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from parallax.testing import context, run_ranks


class Tiny(nn.Module):
    def __init__(self, ctx, hidden=8) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(11, hidden, ctx=ctx)  # padded to a multiple of tp
        self.qkv = ColumnParallelLinear(hidden, 24, bias=False, partitions=3, ctx=ctx)
        self.up = ColumnParallelLinear(hidden, 16, ctx=ctx)
        self.down = RowParallelLinear(16, hidden, ctx=ctx)
        self.norm = nn.LayerNorm(hidden)


def _save_and_reload_at_tp2(root):
    ctx = context(tp=2)
    model = Tiny(ctx)
    init_parameters(model, seed=7, prefix="model.")
    sources = module_sources(model, ctx.tp_group, write=ctx.tp_rank == 0, prefix="model.")
    path = save_checkpoint(root, 1, sources, group=ctx.world_group)
    fresh = Tiny(ctx)
    load_module(fresh, Checkpoint(path), prefix="model.")
    return str(path), all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_save_at_tp2_load_at_tp1_and_tp2(tmp_path):
    results = run_ranks(_save_and_reload_at_tp2, 2, str(tmp_path / "ckpt"))
    assert all(same for _, same in results)
    ckpt = Checkpoint(results[0][0])
    ref = Tiny(None)
    init_parameters(ref, seed=7, prefix="model.")
    assert ckpt.names() == sorted(f"model.{n}" for n, _ in ref.named_parameters())
    loaded = Tiny(None)
    load_module(loaded, ckpt, prefix="model.")
    for (name, a), b in zip(ref.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(
        CheckpointError,
        match=r"'model\.embed\.weight': checkpoint has shape \[11, 8\], the model expects \[11, 4",
    ):
        load_module(Tiny(None, hidden=4), ckpt, prefix="model.")
    with pytest.raises(CheckpointError, match="lacks 8 tensors"):
        load_module(Tiny(None), ckpt, prefix="other.")
