"""LoRA layers of one shape compile once: nothing a forward reads differs between layers.

``torch.compile`` guards on every attribute a forward touches. A guard on something each layer
holds differently (the adapters' names, say) recompiles every layer of a 7B model anew, until
the recompile limit sends the rest to eager code: the compiled LoRA step then takes minutes to
start and runs no faster.
"""

import pytest
import torch
from torch import nn

from parallax.tensor import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.lora import add_adapter


class Block(nn.Module):
    """A fused q/k/v-like column layer with three adapters, then a row layer with one."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.up = ColumnParallelLinear.from_dense(nn.Linear(8, 12), None, partitions=3)
        self.down = RowParallelLinear.from_dense(nn.Linear(12, 8), None, input_is_parallel=False)
        names = tuple(f"layers.{index}.{p}_proj" for p in "qkv")
        add_adapter(self.up, names, rank=2, alpha=4.0, seed=index)
        add_adapter(self.down, (f"layers.{index}.o_proj",), rank=2, alpha=4.0, seed=index)
        for p in (self.up.weight, self.up.bias, self.down.weight, self.down.bias):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.skipif(torch.__version__ < "2.5", reason="torch < 2.5 guards on each module object")
def test_lora_blocks_of_one_shape_share_one_graph():
    graphs = []

    def backend(gm, example_inputs):  # counts what the compiler hands over, runs it as is
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    blocks = [Block(i) for i in range(4)]
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = x
    for block in blocks:
        y = block(y)
    y.sum().backward()
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 blocks of one shape"
    assert all(b.up.lora_B.grad is not None for b in blocks)
    torch._dynamo.reset()
