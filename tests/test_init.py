"""The same seed gives the same logical weights whatever the tp size."""

import torch
from torch import nn
from torch.testing import assert_close

from parallax import init_parameters, param_seed
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from parallax.tensor.sharding import full_tensor
from parallax.testing import context, run_ranks


class Tiny(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(101, 8, ctx=ctx)
        self.up = ColumnParallelLinear(8, 16, ctx=ctx)
        self.qkv = ColumnParallelLinear(8, 24, bias=False, partitions=3, ctx=ctx)
        self.down = RowParallelLinear(16, 8, ctx=ctx)
        self.norm = nn.LayerNorm(8)


def _logical_weights(tp):
    ctx = context(tp=tp)
    model = Tiny(ctx)
    init_parameters(model, seed=1234)
    return {n: full_tensor(p, ctx.tp_group) for n, p in model.named_parameters()}


def test_init_is_identical_across_tp_sizes():
    ref = _logical_weights_local()
    for tp in (2, 4):
        for rank_weights in run_ranks(_logical_weights, tp, tp):
            assert rank_weights.keys() == ref.keys()
            for name, value in ref.items():
                assert_close(rank_weights[name], value, rtol=0, atol=0, msg=name)


def _logical_weights_local():
    model = Tiny(None)
    init_parameters(model, seed=1234)
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert out["up.bias"].abs().sum() == 0 and (out["norm.weight"] == 1).all()
    assert out["embed.weight"].std() > 0.01
    return out


def test_seed_and_name_both_matter():
    assert param_seed(0, "a") != param_seed(1, "a") != param_seed(0, "b")
    a, b = Tiny(None), Tiny(None)
    init_parameters(a, seed=1)
    init_parameters(b, seed=1, prefix="model.")  # other names -> other values
    assert not torch.equal(a.up.weight, b.up.weight)
